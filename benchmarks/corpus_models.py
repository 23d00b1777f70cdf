"""The models of the corpus (benchmarks/corpus.py), built from code and configs: nothing is
downloaded. Every builder takes the batch size and returns (torch module, input shapes); the
module has seeded random weights. transformers models take `inputs_embeds` (float) where they
would take token ids, so every input is float32 and the C timing program can fill it.
"""
from __future__ import annotations

import math

from benchmarks.bench import encoder, lstm
from tests import zoo


def _torch():
    import torch
    return torch


def _seeded(module, seed=0):
    """Seeded weights (He-scaled, so activations stay O(1) through deep stacks) and BatchNorm
    statistics that are not the identity; the module in eval mode."""
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            weight = getattr(m, "weight", None)
            if isinstance(m, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)):
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(1 + 0.1 * torch.rand(m.running_var.shape, generator=gen))
            elif isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.ConvTranspose2d, torch.nn.Linear)):
                fan_in = weight[0].numel()
                weight.copy_(torch.randn(weight.shape, generator=gen) * (2.0 / fan_in) ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
    return module.eval()


def _hf(model_cls, config, seed=0):
    """A transformers model of `config` with seeded random weights (its own initialiser)."""
    torch = _torch()
    torch.manual_seed(seed)
    config._attn_implementation = "eager"   # plain MatMul/Softmax attention in the export
    return model_cls(config).eval()


class _FirstOutput:
    """Wraps a transformers model: forward(x) -> its first output tensor, from `kwarg`=x."""

    def __new__(cls, model, kwarg):
        torch = _torch()

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, x):
                out = self.model(**{kwarg: x}, return_dict=True)
                return out[0] if isinstance(out, tuple) else next(iter(out.values()))
        return Wrapped().eval()


# -- transformers configs ------------------------------------------------------------------------

def vit_tiny(batch):
    """ViT-tiny: 16x16 stride-16 patch embedding, 197 tokens, hidden 192, 12 layers, 3 heads."""
    from transformers import ViTConfig, ViTModel
    cfg = ViTConfig(hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768,
                    image_size=224, patch_size=16)
    return _FirstOutput(_hf(ViTModel, cfg), "pixel_values"), {"x": (batch, 3, 224, 224)}


def deit_tiny(batch):
    """DeiT-tiny dimensions (class + distillation tokens: 198), 4 of its 12 layers."""
    from transformers import DeiTConfig, DeiTModel
    cfg = DeiTConfig(hidden_size=192, num_hidden_layers=4, num_attention_heads=3, intermediate_size=768,
                     image_size=224, patch_size=16)
    return _FirstOutput(_hf(DeiTModel, cfg), "pixel_values"), {"x": (batch, 3, 224, 224)}


def convnext(batch):
    """ConvNeXt (7x7 depthwise convs, channels-last LayerNorm), widths 48..384, depths 2,2,4,2."""
    from transformers import ConvNextConfig, ConvNextModel
    cfg = ConvNextConfig(hidden_sizes=[48, 96, 192, 384], depths=[2, 2, 4, 2])
    return _FirstOutput(_hf(ConvNextModel, cfg), "pixel_values"), {"x": (batch, 3, 224, 224)}


def whisper_encoder(batch):
    """Whisper-tiny's encoder (d 384, 4 layers, 6 heads; Conv1d front end 80 -> 384, k3, strides
    1 and 2) on 5 s of audio: 500 mel frames, 250 tokens."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    cfg = WhisperConfig(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                        num_mel_bins=80, max_source_positions=250)
    return _FirstOutput(_hf(WhisperEncoder, cfg), "input_features"), {"x": (batch, 80, 500)}


def wav2vec2_features(batch):
    """Wav2Vec2's feature encoder (7 Conv1d: kernels 10,3,3,3,3,2,2, strides 5,2,...; GroupNorm
    then GELU) at 256 channels on 0.5 s of 16 kHz audio."""
    from transformers import Wav2Vec2Config
    from transformers.models.wav2vec2.modeling_wav2vec2 import Wav2Vec2FeatureEncoder
    cfg = Wav2Vec2Config(conv_dim=(256,) * 7)
    torch = _torch()
    torch.manual_seed(0)

    class Features(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Wav2Vec2FeatureEncoder(cfg)

        def forward(self, x):
            return self.encoder(x)
    return Features().eval(), {"x": (batch, 8000)}


def distilbert(batch):
    """DistilBERT's layers (post-norm, GELU) at d 384, 6 heads, 4 layers, 128 tokens (inputs_embeds)."""
    from transformers import DistilBertConfig, DistilBertModel
    cfg = DistilBertConfig(dim=384, n_layers=4, n_heads=6, hidden_dim=1536)
    return _FirstOutput(_hf(DistilBertModel, cfg), "inputs_embeds"), {"x": (batch, 128, 384)}


def t5_encoder(batch):
    """T5-small's encoder (d 512, 8 heads, ff 2048, RMSNorm, relative position bias), 6 layers,
    64 tokens (inputs_embeds)."""
    from transformers import T5Config, T5EncoderModel
    cfg = T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64)
    return _FirstOutput(_hf(T5EncoderModel, cfg), "inputs_embeds"), {"x": (batch, 64, 512)}


# -- classic CNNs ----------------------------------------------------------------------------------

def _cbr(nn, cin, cout, k=3, stride=1, act=None):
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout),
                         act or nn.ReLU())


def vgg_style(batch):
    """VGG-11's layout at half width (32..256 channels), 224 x 224, 3x3 convs and max pools."""
    torch = _torch()
    nn = torch.nn
    layers, cin = [], 3
    for v in (32, "M", 64, "M", 128, 128, "M", 256, 256, "M", 256, 256, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU()]
            cin = v
    net = nn.Sequential(*layers, nn.Flatten(), nn.Linear(256 * 7 * 7, 512), nn.ReLU(), nn.Linear(512, 100))
    return _seeded(net), {"x": (batch, 3, 224, 224)}


def densenet_style(batch):
    """DenseNet blocks (BN-ReLU-1x1-BN-ReLU-3x3, growth 16, every layer concatenated), 3 blocks of
    4 layers with transitions, 96 x 96."""
    torch = _torch()
    nn = torch.nn

    class Dense(nn.Module):
        def __init__(self, cin, growth=16):
            super().__init__()
            self.f = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, 4 * growth, 1, bias=False),
                                   nn.BatchNorm2d(4 * growth), nn.ReLU(), nn.Conv2d(4 * growth, growth, 3, 1, 1,
                                                                                     bias=False))

        def forward(self, x):
            return torch.cat([x, self.f(x)], 1)

    layers, c = [nn.Conv2d(3, 32, 3, 2, 1, bias=False)], 32
    for block in range(3):
        for _ in range(4):
            layers.append(Dense(c))
            c += 16
        if block < 2:
            layers += [nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False), nn.AvgPool2d(2)]
            c //= 2
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))
    return _seeded(net), {"x": (batch, 3, 96, 96)}


def efficientnet_style(batch):
    """EfficientNet-B0-like: MBConv blocks (1x1 expand, depthwise 3x3/5x5, squeeze-excitation,
    SiLU, 1x1 project, residual), 224 x 224, 5 stages."""
    torch = _torch()
    nn = torch.nn

    class MBConv(nn.Module):
        def __init__(self, cin, cout, k, stride, expand):
            super().__init__()
            mid = cin * expand
            self.res = stride == 1 and cin == cout
            self.expand = _cbr(nn, cin, mid, 1, act=nn.SiLU()) if expand > 1 else nn.Identity()
            self.dw = nn.Sequential(nn.Conv2d(mid, mid, k, stride, k // 2, groups=mid, bias=False),
                                    nn.BatchNorm2d(mid), nn.SiLU())
            self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(mid, max(1, cin // 4), 1), nn.SiLU(),
                                    nn.Conv2d(max(1, cin // 4), mid, 1), nn.Sigmoid())
            self.project = nn.Sequential(nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.dw(self.expand(x))
            y = self.project(y * self.se(y))
            return x + y if self.res else y

    stages = [(16, 24, 3, 2, 6, 2), (24, 40, 5, 2, 6, 2), (40, 80, 3, 2, 6, 2), (80, 112, 5, 1, 6, 2),
              (112, 192, 5, 2, 6, 2)]
    layers = [_cbr(nn, 3, 32, 3, 2, nn.SiLU()), MBConv(32, 16, 3, 1, 1)]
    for cin, cout, k, stride, expand, repeat in stages:
        for i in range(repeat):
            layers.append(MBConv(cin if i == 0 else cout, cout, k, stride if i == 0 else 1, expand))
    net = nn.Sequential(*layers, _cbr(nn, 192, 640, 1, act=nn.SiLU()), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(640, 100))
    return _seeded(net), {"x": (batch, 3, 224, 224)}


def unet(batch):
    """A U-Net (tests/zoo.py's: ConvTranspose upsampling, skip concatenations) at 128 x 128."""
    return zoo.unet_style(), {"input": (batch, 3, 128, 128)}


def _pyramid_neck(nn, torch, chans, out):
    """FPN-style neck: lateral 1x1 convs, nearest Upsample x2 + Concat of every level with the one
    above, a 3x3 conv after each merge."""
    class Neck(nn.Module):
        def __init__(self):
            super().__init__()
            self.lateral = nn.ModuleList(nn.Conv2d(c, out, 1) for c in chans)
            self.merge = nn.ModuleList(_cbr(nn, 2 * out, out) for _ in chans[:-1])
            self.up = nn.Upsample(scale_factor=2, mode="nearest")

        def forward(self, feats):
            lat = [f(x) for f, x in zip(self.lateral, feats)]
            y, outs = lat[-1], [lat[-1]]
            for i in range(len(lat) - 2, -1, -1):
                y = self.merge[i](torch.cat([self.up(y), lat[i]], 1))
                outs.insert(0, y)
            return outs
    return Neck()


def _backbone(nn, widths):
    """Strided conv stages (each: a stride-2 3x3 conv then a 3x3 conv): the feature maps at
    strides 4, 8, 16 and 32 for widths[1:]."""
    stem = nn.Sequential(_cbr(nn, 3, widths[0], 3, 2), _cbr(nn, widths[0], widths[0]))
    stages = nn.ModuleList(nn.Sequential(_cbr(nn, cin, cout, 3, 2), _cbr(nn, cout, cout))
                           for cin, cout in zip(widths, widths[1:]))
    return stem, stages


def yolo_neck(batch):
    """A YOLO-style detector at 320 x 320: strided backbone, an FPN neck with Upsample + Concat,
    a 1x1 detection head per level (3 anchors x 85)."""
    torch = _torch()
    nn = torch.nn

    class Yolo(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.stages = _backbone(nn, (16, 32, 64, 128, 256))
            self.neck = _pyramid_neck(nn, torch, (64, 128, 256), 64)
            self.heads = nn.ModuleList(nn.Conv2d(64, 255, 1) for _ in range(3))

        def forward(self, x):
            feats, y = [], self.stem(x)
            for stage in self.stages:
                y = stage(y)
                feats.append(y)
            outs = self.neck(feats[1:])
            return torch.cat([h(o).flatten(2) for h, o in zip(self.heads, outs)], 2)
    return _seeded(Yolo()), {"x": (batch, 3, 320, 320)}


def dbnet(batch):
    """A DBNet-style text detector at 640 x 640: strided backbone (strides 4..32), FPN with
    Upsample + Concat, every level upsampled to 1/4 and concatenated, the probability head
    (3x3 conv, two stride-2 ConvTranspose, Sigmoid)."""
    torch = _torch()
    nn = torch.nn

    class DBNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.stages = _backbone(nn, (16, 24, 48, 96, 192))
            self.neck = _pyramid_neck(nn, torch, (24, 48, 96, 192), 32)
            self.ups = nn.ModuleList(nn.Upsample(scale_factor=2 ** i, mode="nearest") for i in range(4))
            self.head = nn.Sequential(_cbr(nn, 128, 32), nn.ConvTranspose2d(32, 32, 2, 2), nn.BatchNorm2d(32),
                                      nn.ReLU(), nn.ConvTranspose2d(32, 1, 2, 2), nn.Sigmoid())

        def forward(self, x):
            feats, y = [], self.stem(x)
            for stage in self.stages:
                y = stage(y)
                feats.append(y)
            outs = self.neck(feats)
            return self.head(torch.cat([up(o) for up, o in zip(self.ups, outs)], 1))
    return _seeded(DBNet()), {"x": (batch, 3, 640, 640)}


# -- audio front ends ----------------------------------------------------------------------------

N_FFT, HOP = 256, 128   # the STFT as a Conv1d: 1 input channel, 2 x 129 = 258 outputs, kernel 256, stride 128


def _stft_conv(nn, torch):
    """A Conv1d holding the real and imaginary DFT rows of a Hann-windowed 256-point frame."""
    conv = nn.Conv1d(1, 2 * (N_FFT // 2 + 1), N_FFT, HOP, bias=False)
    n = torch.arange(N_FFT, dtype=torch.float64)
    f = torch.arange(N_FFT // 2 + 1, dtype=torch.float64)[:, None]
    window = torch.hann_window(N_FFT, periodic=True, dtype=torch.float64)
    angle = 2 * math.pi * f * n / N_FFT
    with torch.no_grad():
        conv.weight.copy_(torch.cat([torch.cos(angle) * window, -torch.sin(angle) * window])[:, None].float())
    return conv


def stft_conv(batch):
    """The STFT alone, as a Conv1d over 1024 samples: 7 frames."""
    torch = _torch()
    return _stft_conv(torch.nn, torch).eval(), {"x": (batch, 1, 1024)}


class _Magnitude:
    def __new__(cls):
        torch = _torch()

        class Magnitude(torch.nn.Module):
            def forward(self, spec):   # [N, 2F, T] -> sqrt(re^2 + im^2), [N, F, T]
                re, im = spec.chunk(2, 1)
                return torch.sqrt(re * re + im * im + 1e-9)
        return Magnitude()


def stft_lstm(batch):
    """The issue's audio model: STFT Conv1d front end (1024 samples, 7 frames), magnitude, two
    small Conv1d (129 -> 64 -> 64, k3), an LSTM of 64 and a linear head."""
    torch = _torch()
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stft, self.mag = _stft_conv(nn, torch), _Magnitude()
            self.convs = nn.Sequential(nn.Conv1d(129, 64, 3, padding=1), nn.ReLU(), nn.Conv1d(64, 64, 3, padding=1),
                                       nn.ReLU())
            self.rnn = nn.LSTM(64, 64, batch_first=True)
            self.out = nn.Linear(64, 2)

        def forward(self, x):
            y = self.convs(self.mag(self.stft(x)))
            return self.out(self.rnn(y.transpose(1, 2))[0])
    net = _seeded(Net())
    net.stft = _stft_conv(nn, torch)
    return net.eval(), {"x": (batch, 1, 1024)}


def mel(batch):
    """A log-mel front end: STFT Conv1d over 1 s of 16 kHz audio (124 frames), power, 64 mel
    filters as a MatMul, log."""
    torch = _torch()
    nn = torch.nn

    class Mel(nn.Module):
        def __init__(self):
            super().__init__()
            self.stft = _stft_conv(nn, torch)
            fb = torch.relu(1 - torch.abs(torch.linspace(0, 63, N_FFT // 2 + 1)[None] - torch.arange(64.0)[:, None]))
            self.register_buffer("fb", fb)

        def forward(self, x):
            re, im = self.stft(x).chunk(2, 1)
            return torch.log(torch.matmul(self.fb, re * re + im * im) + 1e-6)
    return Mel().eval(), {"x": (batch, 1, 16000)}


def tcn(batch):
    """A 1-D temporal conv stack (TCN): 6 dilated k3 Conv1d (dilations 1..32) of 128 channels with
    residuals, over 400 steps of 40 features."""
    torch = _torch()
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.conv = nn.Conv1d(128, 128, 3, padding=d, dilation=d)
            self.bn = nn.BatchNorm1d(128)

        def forward(self, x):
            return torch.relu(x + self.bn(self.conv(x)))

    net = nn.Sequential(nn.Conv1d(40, 128, 1), *[Block(2 ** i) for i in range(6)], nn.Conv1d(128, 10, 1))
    return _seeded(net), {"x": (batch, 40, 400)}


def vad(batch):
    """A streaming VAD-style model (Silero's shape): one 512-sample chunk, STFT Conv1d (3 frames),
    magnitude, 4 Conv1d encoder layers, an LSTM cell whose state (h, c) comes in and goes out,
    a sigmoid speech probability."""
    torch = _torch()
    nn = torch.nn

    class VAD(nn.Module):
        def __init__(self):
            super().__init__()
            self.stft, self.mag = _stft_conv(nn, torch), _Magnitude()
            chans = (129, 128, 64, 64, 128)
            self.enc = nn.Sequential(*[m for a, b in zip(chans, chans[1:]) for m in (nn.Conv1d(a, b, 3, padding=1),
                                                                                     nn.ReLU())])
            self.cell = nn.LSTMCell(128, 128)
            self.out = nn.Linear(128, 1)

        def forward(self, x, h, c):
            y = self.enc(self.mag(self.stft(x))).mean(2)
            h, c = self.cell(y, (h, c))
            return torch.sigmoid(self.out(h)), h, c
    net = _seeded(VAD())
    net.stft = _stft_conv(nn, torch)
    return net.eval(), {"x": (batch, 1, 512), "h": (batch, 128), "c": (batch, 128)}


# -- the existing zoo (benchmarks/bench.py's models) -------------------------------------------------

def zoo_mlp(batch):
    return zoo.mlp(), {"x": (batch, 256)}


def zoo_resnet18(batch):
    return zoo.resnet((2, 2, 2, 2)), {"input": (batch, 3, 224, 224)}


def zoo_resnet50(batch):
    return zoo.resnet((3, 4, 6, 3), bottleneck=True), {"input": (batch, 3, 224, 224)}


def zoo_mobilenet_v2(batch):
    return zoo.mobilenet_v2(), {"input": (batch, 3, 224, 224)}


def zoo_encoder(batch):
    return encoder(), {"x": (batch, 128, 256)}


def zoo_encoder_t16(batch):
    return encoder(layers=1), {"x": (batch, 16, 256)}


def zoo_lstm(batch):
    return lstm(), {"x": (32, batch, 64)}   # sequence first


# name -> (builder, the larger batch). Heavy models take batch 2 as their larger batch.
CORPUS = {
    "vit_tiny": (vit_tiny, 4), "deit_tiny": (deit_tiny, 4), "convnext": (convnext, 4),
    "whisper_encoder": (whisper_encoder, 4), "wav2vec2_features": (wav2vec2_features, 4),
    "distilbert": (distilbert, 4), "t5_encoder": (t5_encoder, 4),
    "vgg_style": (vgg_style, 2), "densenet_style": (densenet_style, 4), "efficientnet_style": (efficientnet_style, 4),
    "unet": (unet, 4), "yolo_neck": (yolo_neck, 2), "dbnet": (dbnet, 2),
    "stft_conv": (stft_conv, 8), "stft_lstm": (stft_lstm, 8), "mel": (mel, 8), "tcn": (tcn, 8), "vad": (vad, 8),
    "mlp": (zoo_mlp, 8), "resnet18": (zoo_resnet18, 4), "resnet50": (zoo_resnet50, 2),
    "mobilenet_v2": (zoo_mobilenet_v2, 4), "encoder": (zoo_encoder, 4), "encoder_t16": (zoo_encoder_t16, 8),
    "lstm": (zoo_lstm, 8),
}
# --quick: one model of each kind, small enough for a 2-core machine
QUICK = ("vit_tiny", "whisper_encoder", "distilbert", "densenet_style", "yolo_neck", "stft_conv", "stft_lstm", "tcn",
         "vad", "mobilenet_v2")
