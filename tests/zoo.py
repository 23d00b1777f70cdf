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


def export(module, shapes: dict, opset: int = 17, int_inputs=()) -> onnx.ModelProto:
    """Export with zero example inputs of these shapes (int64 for the names in int_inputs)."""
    torch = _torch()
    module = module.eval()
    args = tuple(torch.zeros(s, dtype=torch.int64 if name in int_inputs else torch.float32)
                 for name, s in shapes.items())
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


def bert_encoder(layers=2, d=64, heads=4, ff=128, vocab=100, seq=16, seed=0):
    """A BERT-style encoder: token + position embeddings, attention with a padding mask,
    LayerNorm, GELU. Inputs: ids [1, seq] int64, mask [1, seq] float (1 = keep)."""
    torch = _torch()
    nn = torch.nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.out = nn.Linear(d, d)
            self.ln1 = nn.LayerNorm(d)
            self.ff1 = nn.Linear(d, ff)
            self.ff2 = nn.Linear(ff, d)
            self.ln2 = nn.LayerNorm(d)

        def forward(self, x, bias):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).split(d, dim=-1)
            q = q.reshape(b, t, heads, d // heads).transpose(1, 2)
            k = k.reshape(b, t, heads, d // heads).transpose(1, 2)
            v = v.reshape(b, t, heads, d // heads).transpose(1, 2)
            att = (q @ k.transpose(-1, -2)) / (d // heads) ** 0.5 + bias
            y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
            x = self.ln1(x + self.out(y))
            return self.ln2(x + self.ff2(torch.nn.functional.gelu(self.ff1(x))))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))

        def forward(self, ids, mask):
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            x = self.tok(ids) + self.pos(positions)
            bias = (1.0 - mask[:, None, None, :]) * -10000.0
            for layer in self.layers:
                x = layer(x, bias)
            return x

    torch.manual_seed(seed)
    return Encoder()


def gpt2_block(d=64, heads=4, seq=16, seed=0):
    """A GPT-2-style decoder block with a causal mask. Input: x [1, seq, d]."""
    torch = _torch()
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)
            self.register_buffer("causal", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.attn(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.reshape(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-1, -2)) * (1.0 / (d // heads) ** 0.5)
            att = att.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(torch.nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    torch.manual_seed(seed)
    return Block()


def lstm_model(inp=16, hidden=32, layers=2, seed=0):
    torch = _torch()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(inp, hidden, num_layers=layers, batch_first=True)
            self.head = torch.nn.Linear(hidden, 4)

        def forward(self, x):
            y, _ = self.rnn(x)
            return self.head(y)

    torch.manual_seed(seed)
    return M()


def gru_model(inp=16, hidden=32, seed=0):
    torch = _torch()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.GRU(inp, hidden, batch_first=True, bidirectional=True)
            self.head = torch.nn.Linear(2 * hidden, 4)

        def forward(self, x):
            y, _ = self.rnn(x)
            return self.head(y)

    torch.manual_seed(seed)
    return M()


def yolo_style(classes=3, seed=0):
    """A small YOLO-style detector: strided conv backbone, a nearest-neighbour
    upsample (Resize) merged with a skip (Concat), and a head split (Split) into
    box / objectness / class parts with Sigmoid. Input [1, 3, 64, 64]."""
    torch = _torch()
    nn = torch.nn

    def block(cin, cout, stride):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1))

    class Yolo(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = block(3, 16, 2)
            self.c2 = block(16, 32, 2)
            self.c3 = block(32, 64, 2)
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.fuse = block(64 + 32, 32, 1)
            self.head = nn.Conv2d(32, 3 * (5 + classes), 1)

        def forward(self, x):
            a = self.c2(self.stem(x))
            b = self.c3(a)
            y = self.head(self.fuse(torch.cat([self.up(b), a], 1)))
            n, _, h, w = y.shape
            y = y.reshape(n, 3, 5 + classes, h, w)
            box, obj, cls = torch.split(y, [4, 1, classes], dim=2)
            return torch.cat([box, torch.sigmoid(obj), torch.sigmoid(cls)], 2)

    return _randomise(Yolo(), seed)


def unet_style(seed=0):
    """A U-Net-style model: two downsampling stages, ConvTranspose upsampling, skips. Input [1, 3, 32, 32]."""
    torch = _torch()
    nn = torch.nn

    def double(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), nn.ReLU(), nn.Conv2d(cout, cout, 3, 1, 1), nn.ReLU())

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.d1, self.d2, self.mid = double(3, 16), double(16, 32), double(32, 64)
            self.pool = nn.MaxPool2d(2)
            self.u2 = nn.ConvTranspose2d(64, 32, 2, 2)
            self.e2 = double(64, 32)
            self.u1 = nn.ConvTranspose2d(32, 16, 2, 2)
            self.e1 = double(32, 16)
            self.out = nn.Conv2d(16, 2, 1)

        def forward(self, x):
            a = self.d1(x)
            b = self.d2(self.pool(a))
            m = self.mid(self.pool(b))
            y = self.e2(torch.cat([self.u2(m), b], 1))
            y = self.e1(torch.cat([self.u1(y), a], 1))
            return self.out(y)

    return _randomise(UNet(), seed)


# -- graph neural networks: message passing over an edge list ----------------------------------
# Inputs: x [nodes, features] float, edge_index [2, edges] int64 (row 0: source, row 1:
# destination). Aggregations are written with the ops torch users write (index_add_,
# scatter_reduce); `edge_index` for tests and benchmarks comes from `random_edges`.

def random_edges(nodes, edges, seed=3):
    """[2, edges] int64 edge list with repeated destinations (and every node a destination of
    at least one edge when edges >= nodes, so no mean is over zero messages but some are)."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, nodes, edges)
    dst = rng.integers(0, nodes, edges)
    if edges >= 2 * nodes:
        dst[:nodes - 1] = np.arange(nodes - 1)  # node nodes-1 may stay without messages
    return np.stack([src, dst]).astype(np.int64)


def _segment_sum(torch, shape, index, dst, values, style):
    """sum of `values` rows into `shape` by destination: index_add_ (what users write; the
    TorchScript exporter refuses it with repeated indices) or scatter_add (both exporters)."""
    if style == "index_add":
        return torch.zeros(shape).index_add_(0, dst, values)
    return torch.zeros(shape).scatter_add(0, index, values)


def _segment_max(torch, shape, index, values, style):
    """max of `values` rows by destination, 0 where none: scatter_reduce(include_self=False), or
    (the TorchScript exporter refuses that) from -inf with include_self=True, then -inf -> 0."""
    if style == "index_add":
        return torch.zeros(shape).scatter_reduce(0, index, values, "amax", include_self=False)
    top = torch.full(shape, float("-inf")).scatter_reduce(0, index, values, "amax", include_self=True)
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)


def graphsage(nodes, features=32, hidden=32, out=8, aggr=("mean", "max"), style="index_add", seed=0):
    """Two GraphSAGE layers (SAGEConv: lin_l(aggregate of neighbours) + lin_r(self)), the first
    aggregating by `aggr[0]`, the second by `aggr[1]`: mean = the sum of the messages divided by
    their count, max = the segment max, 0 where no message; sums and maxima written as `style`
    says (_segment_sum, _segment_max)."""
    torch = _torch()
    nn = torch.nn

    class SAGEConv(nn.Module):
        def __init__(self, a, b, how):
            super().__init__()
            self.lin_l, self.lin_r, self.how = nn.Linear(a, b), nn.Linear(a, b, bias=False), how

        def forward(self, x, src, dst):
            msg = x[src]
            index = dst.unsqueeze(1).expand(-1, x.shape[1])
            if self.how == "mean":
                total = _segment_sum(torch, (nodes, x.shape[1]), index, dst, msg, style)
                count = _segment_sum(torch, (nodes,), dst, dst, torch.ones_like(dst, dtype=x.dtype), style)
                agg = total / count.clamp(min=1).unsqueeze(1)
            else:
                agg = _segment_max(torch, (nodes, x.shape[1]), index, msg, style)
            return self.lin_l(agg) + self.lin_r(x)

    class GraphSAGE(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = SAGEConv(features, hidden, aggr[0])
            self.conv2 = SAGEConv(hidden, out, aggr[1])

        def forward(self, x, edge_index):
            src, dst = edge_index[0], edge_index[1]
            return self.conv2(torch.relu(self.conv1(x, src, dst)), src, dst)

    torch.manual_seed(seed)
    return GraphSAGE()


def gat(nodes, features=32, heads=4, channels=8, out=8, style="index_add", seed=0):
    """A GAT layer (GATConv: per-head attention logits leaky_relu(a_src . Wx_j + a_dst . Wx_i),
    a softmax over each node's incoming edges: segment max, exp, segment sum), then ELU and a
    linear head; segment ops written as `style` says (_segment_sum, _segment_max)."""
    torch = _torch()
    nn = torch.nn

    class GAT(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(features, heads * channels, bias=False)
            self.att_src = nn.Parameter(torch.randn(1, heads, channels) * 0.3)
            self.att_dst = nn.Parameter(torch.randn(1, heads, channels) * 0.3)
            self.bias = nn.Parameter(torch.randn(heads * channels) * 0.1)
            self.head = nn.Linear(heads * channels, out)

        def forward(self, x, edge_index):
            src, dst = edge_index[0], edge_index[1]
            h = self.lin(x).view(-1, heads, channels)
            alpha_src = (h * self.att_src).sum(-1)
            alpha_dst = (h * self.att_dst).sum(-1)
            e = torch.nn.functional.leaky_relu(alpha_src[src] + alpha_dst[dst], 0.2)     # [edges, heads]
            index = dst.unsqueeze(1).expand(-1, heads)
            e_max = _segment_max(torch, (nodes, heads), index, e, style)
            e = torch.exp(e - e_max[dst])
            denom = _segment_sum(torch, (nodes, heads), index, dst, e, style)
            alpha = e / denom[dst]
            msg = h[src] * alpha.unsqueeze(-1)                                           # [edges, heads, channels]
            index3 = dst.view(-1, 1, 1).expand(-1, heads, channels)
            agg = _segment_sum(torch, (nodes, heads, channels), index3, dst, msg, style)
            y = torch.nn.functional.elu(agg.reshape(nodes, heads * channels) + self.bias)
            return self.head(y)

    torch.manual_seed(seed)
    return GAT()


def fraud_hybrid(nodes=256, steps=16, features=8, hidden=32, edges=2048, style="index_add", seed=0):
    """The design document's fraud detector: an LSTM over each account's last `steps`
    transactions (seq [nodes, steps, features]), its last hidden state the account's embedding;
    one GraphSAGE layer (mean of the neighbours' embeddings, lin_l(mean) + lin_r(self)) over the
    transaction graph (edge_index [2, edges]: payer -> payee); a small head to one fraud
    probability per account (sigmoid), [nodes, 1]. Segment sums written as `style` says."""
    torch = _torch()
    nn = torch.nn

    class FraudHybrid(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(features, hidden, batch_first=True)
            self.lin_l, self.lin_r = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden, bias=False)
            self.head = nn.Sequential(nn.Linear(2 * hidden, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, seq, edge_index):
            _, (h, _) = self.rnn(seq)
            emb = h[-1]                                                     # [nodes, hidden]
            src, dst = edge_index[0], edge_index[1]
            index = dst.unsqueeze(1).expand(-1, hidden)
            total = _segment_sum(torch, (nodes, hidden), index, dst, emb[src], style)
            count = _segment_sum(torch, (nodes,), dst, dst, torch.ones_like(dst, dtype=emb.dtype), style)
            graph = torch.relu(self.lin_l(total / count.clamp(min=1).unsqueeze(1)) + self.lin_r(emb))
            return torch.sigmoid(self.head(torch.cat([emb, graph], dim=1)))

    torch.manual_seed(seed)
    return _randomise(FraudHybrid(), seed)   # He-scaled Linear weights: the probabilities spread out
