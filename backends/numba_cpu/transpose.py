"""TODO: being written."""


def lower_transpose(node, graph):
    raise NotImplementedError(node.op)
