"""Test and benchmark models: torch modules with seeded random weights,
exported to ONNX in memory. Nothing is downloaded."""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx


def _torch():
    import torch
    return torch


def export(module, shapes: dict, opset: int = 17) -> onnx.ModelProto:
    torch = _torch()
    module = module.eval()
    args = tuple(torch.zeros(s) for s in shapes.values())
    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=opset, input_names=list(shapes),
                          output_names=["output"])
    return onnx.load_model_from_string(buf.getvalue())


def _randomise(module, seed):
    """Seeded weights, and BatchNorm statistics that are not the identity."""
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear, torch.nn.ConvTranspose2d)):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * (2.0 / fan_in) ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)
            elif isinstance(m, torch.nn.BatchNorm2d):
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(1 + 0.1 * torch.rand(m.running_var.shape, generator=gen))
    return module


def mlp(sizes=(256, 512, 256, 64, 1), seed=0):
    torch = _torch()
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return _randomise(torch.nn.Sequential(*layers[:-1]), seed)


def resnet(blocks=(2, 2, 2, 2), bottleneck=False, width=64, num_classes=1000, seed=0):
    """ResNet-18 (blocks 2,2,2,2) or ResNet-50 (3,4,6,3, bottleneck) topology."""
    torch = _torch()
    nn = torch.nn

    class Basic(nn.Module):
        expansion = 1

        def __init__(self, cin, c, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, c, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(c)
            self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(c)
            self.down = None
            if stride != 1 or cin != c:
                self.down = nn.Sequential(nn.Conv2d(cin, c, 1, stride, bias=False), nn.BatchNorm2d(c))

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    class Bottle(nn.Module):
        expansion = 4

        def __init__(self, cin, c, stride):
            super().__init__()
            out = c * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                nn.Conv2d(c, c, 3, stride, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                nn.Conv2d(c, out, 1, bias=False), nn.BatchNorm2d(out))
            self.down = None
            if stride != 1 or cin != out:
                self.down = nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))

        def forward(self, x):
            return torch.relu(self.body(x) + (x if self.down is None else self.down(x)))

    block = Bottle if bottleneck else Basic
    layers = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = width
    for stage, n in enumerate(blocks):
        c = width * 2 ** stage
        for i in range(n):
            layers.append(block(cin, c, 2 if i == 0 and stage > 0 else 1))
            cin = c * block.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return _randomise(nn.Sequential(*layers), seed)


def mobilenet_v2(width_mult=1.0, num_classes=1000, seed=0):
    torch = _torch()
    nn = torch.nn

    def c(ch):
        return max(8, int(ch * width_mult + 4) // 8 * 8)

    def conv_bn(cin, cout, k, s, groups=1, act=True):
        mods = [nn.Conv2d(cin, cout, k, s, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        return mods + ([nn.ReLU6()] if act else [])

    class Inverted(nn.Module):
        def __init__(self, cin, cout, stride, expand):
            super().__init__()
            hidden = cin * expand
            mods = (conv_bn(cin, hidden, 1, 1) if expand != 1 else []) + conv_bn(hidden, hidden, 3, stride, hidden) \
                + conv_bn(hidden, cout, 1, 1, act=False)
            self.body = nn.Sequential(*mods)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    settings = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
    layers = conv_bn(3, c(32), 3, 2)
    cin = c(32)
    for t, ch, n, s in settings:
        for i in range(n):
            layers.append(Inverted(cin, c(ch), s if i == 0 else 1, t))
            cin = c(ch)
    layers += conv_bn(cin, 1280, 1, 1) + [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, num_classes)]
    return _randomise(nn.Sequential(*layers), seed)


def sample_input(shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
