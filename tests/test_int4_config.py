"""cuvil.yaml for precision int4: `quantization: {group_size, symmetric}` reaches quantize_weights,
a model's keys over the defaults'; a group size that is not 32, 64 or 128 is a located ConfigError."""
import textwrap

import pytest

from cuvil.config import load_config
from cuvil.errors import ConfigError
from cuvil.pipeline import pass_list

CONFIG = """\
version: 1
defaults:
  precision: int4
  quantization: {group_size: 64}
models:
  - name: decoder
    source: decoder.onnx
    quantization: {symmetric: false}
  - name: fp32
    source: decoder.onnx
    precision: fp32
"""


def _write(tmp_path, text):
    (tmp_path / "decoder.onnx").write_bytes(b"")
    path = tmp_path / "cuvil.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_quantization_reaches_the_pass(tmp_path):
    spec = load_config(_write(tmp_path, CONFIG))
    int4, fp32 = spec.models
    assert int4.quantization.group_size == 64 and not int4.quantization.symmetric
    names, options = pass_list(int4.opt_level, int4.passes, int4.disable_passes, int4.pass_options, int4.precision)
    assert names[0] == "quantize_weights" and "assign_precision" not in names
    assert options["quantize_weights"] == {"bits": 4, "group_size": 64, "symmetric": False, "keep_fp32": [],
                                           "imported_scales": "keep"}
    names, _ = pass_list(fp32.opt_level, fp32.passes, fp32.disable_passes, fp32.pass_options, fp32.precision)
    assert "quantize_weights" not in names


def test_a_group_size_outside_the_list_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="group_size must be one of 32, 64, 128") as info:
        load_config(_write(tmp_path, CONFIG.replace("group_size: 64", "group_size: 48")))
    assert "cuvil.yaml:4" in str(info.value)
