"""A LLaMA-architecture decoder (seeded random weights, written in torch; nothing downloaded) for the
weight-only int4 tests and benchmark: RMSNorm, rotary position embedding, multi-head causal
attention over a key/value cache, SwiGLU MLP, no biases.

One decode step (batch 1, one new token) of `layers` layers:
    inputs  x [1, 1, hidden] (the new token's embedding), past [layers, 2, 1, heads, past_len, head_dim]
    outputs y [1, 1, hidden] (after the final RMSNorm), present [layers, 2, 1, heads, past_len + 1, head_dim]
The embedding table and the vocabulary projection are left out: the test measures the decoder's
products. `quantize` writes the model as onnxruntime's MatMulNBitsQuantizer does (MatMulNBits).
"""
from __future__ import annotations

import io
import math
import warnings

import numpy as np
import onnx


def decoder(hidden=512, layers=8, heads=8, intermediate=1408, past_len=31, seed=0):
    """The torch module of one decode step; its products have 4 h^2 + 3 h i weights per layer."""
    import torch
    nn = torch.nn
    head_dim = hidden // heads

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    def rotate(x, cos, sin):
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_norm, self.post_norm = RMSNorm(), RMSNorm()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden, bias=False)
                                                                  for _ in range(4))
            self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
            self.up_proj = nn.Linear(hidden, intermediate, bias=False)
            self.down_proj = nn.Linear(intermediate, hidden, bias=False)

        def forward(self, x, past, cos, sin):
            h = self.input_norm(x)
            q, k, v = (p(h).reshape(1, 1, heads, head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj,
                                                                                      self.v_proj))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            keys = torch.cat((past[0], k), dim=2)
            values = torch.cat((past[1], v), dim=2)
            att = torch.softmax((q @ keys.transpose(-1, -2)) / math.sqrt(head_dim), dim=-1)
            x = x + self.o_proj((att @ values).transpose(1, 2).reshape(1, 1, hidden))
            h = self.post_norm(x)
            x = x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))
            return x, torch.stack((keys, values))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = RMSNorm()
            inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
            angles = past_len * inv
            self.register_buffer("cos", torch.cat((angles, angles)).cos())
            self.register_buffer("sin", torch.cat((angles, angles)).sin())

        def forward(self, x, past):
            present = []
            for i, layer in enumerate(self.layers):
                x, kv = layer(x, past[i], self.cos, self.sin)
                present.append(kv)
            return self.norm(x), torch.stack(present)

    torch.manual_seed(seed)
    module = Decoder().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) / math.sqrt(m.weight.shape[1]))
            elif isinstance(m, RMSNorm):
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
    return module


def shapes(hidden=512, layers=8, heads=8, past_len=31, **_):
    return {"x": (1, 1, hidden), "past": (layers, 2, 1, heads, past_len, hidden // heads)}


def export(**config) -> onnx.ModelProto:
    import torch
    module = decoder(**config)
    args = tuple(torch.zeros(s) for s in shapes(**config).values())
    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=17, input_names=["x", "past"],
                          output_names=["y", "present"])
    return onnx.load_model_from_string(buf.getvalue())


def inputs(seed=1, **config) -> dict:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes(**config).items()}


def quantize(model: onnx.ModelProto, block_size=32, symmetric=True, bits=4) -> onnx.ModelProto:
    """The model as onnxruntime's MatMulNBitsQuantizer writes it (every MatMul with a constant weight
    -> com.microsoft MatMulNBits)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    copy = onnx.ModelProto()
    copy.CopyFrom(model)        # the quantizer rewrites the model it is given
    quant = MatMulNBitsQuantizer(copy, bits=bits, block_size=block_size, is_symmetric=symmetric)
    quant.process()
    return quant.model.model


def product_params(model: onnx.ModelProto) -> int:
    """The weights of the MatMulNBits nodes (K * N each)."""
    total = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            total += attrs["K"] * attrs["N"]
    return total
