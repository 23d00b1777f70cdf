"""TODO: being written."""


def lower_concat(node, graph):
    raise NotImplementedError(node.op)
