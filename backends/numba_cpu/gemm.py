"""TODO: being written."""


def lower_gemm(node, graph):
    raise NotImplementedError(node.op)


def lower_matmul(node, graph):
    raise NotImplementedError(node.op)
