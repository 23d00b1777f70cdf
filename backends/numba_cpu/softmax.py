"""TODO: being written."""


def lower_softmax(node, graph):
    raise NotImplementedError(node.op)
