"""TODO: being written."""


def lower_maxpool(node, graph):
    raise NotImplementedError(node.op)


def lower_averagepool(node, graph):
    raise NotImplementedError(node.op)


def lower_global_averagepool(node, graph):
    raise NotImplementedError(node.op)


def lower_global_maxpool(node, graph):
    raise NotImplementedError(node.op)
