"""TODO: being written."""


def lower_conv(node, graph):
    raise NotImplementedError(node.op)
