"""TODO: being written."""


def lower_batchnorm(node, graph):
    raise NotImplementedError(node.op)
