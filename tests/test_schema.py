"""The JSON Schema of cuvil.yaml (`cuvil schema`, docs/cuvil.schema.json) against the config loader.

An editor validates cuvil.yaml with the schema and cuvil with `load_config`:
both must accept the example and every config the tests write, and both must
reject the same mistakes (each bad config below is refused by the schema and
raises ConfigError when loaded).
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import jsonschema
import pytest
import yaml

from cuvil.cli import main
from cuvil.config import json_schema, load_config
from cuvil.errors import ConfigError

from tests.test_c_abi import SECOND_MODEL
from tests.test_cli import EXAMPLE_CONFIG, write_example_project
from tests.test_config import VALID
from tests.test_watch import CONFIG as WATCH_CONFIG

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_FILE = ROOT / "docs" / "cuvil.schema.json"

# Configs other test modules write (copied where importing the module would need its extras).
WRITTEN = {
    "test_config.VALID": VALID,
    "test_watch.CONFIG": WATCH_CONFIG.format(cache="/tmp/cache"),
    "test_serve.CONFIG": """\
        version: 1
        output_dir: out
        cache: {dir: /tmp/cache}
        models:
          - name: affine
            source: models/affine.onnx
            serve: {priority: critical, deadline_ms: 5000, max_concurrency: 2}
          - name: scale
            source: models/scale.onnx
            inputs: {x: [2, 4]}
            serve: {priority: low}
        watch: {debounce_ms: 50}
        incremental: {enabled: true, diff_mode: semantic}
        """,
    "hardening/test_fuzz.CONFIG": """\
        version: 1
        output_dir: out
        defaults:
          threads: 1
        models:
          - name: m
            source: m.onnx
            inputs: {x: [2, 6]}
            targets: [native]
        watch: {paths: [], debounce_ms: 100}
        """,
    "test_accuracy": """\
        version: 1
        output_dir: out
        cache: {dir: /tmp/cache}
        models:
          - name: mlp
            source: mlp.onnx
            precision: bf16
            accuracy: {samples: 4, inputs: samples.npz, min_cosine: 0.999}
        """,
    "test_passes/test_pipeline": """\
        version: 1
        defaults:
          pass_options:
            fuse_elementwise: {max_ops: 4}
        models:
          - name: m
            source: m.onnx
            pass_options:
              fuse_elementwise: {max_inputs: 3}
        """,
    "test_cuda": """\
        version: 1
        models:
          - name: small
            source: small.onnx
            inputs:
              x: [2, 3, 8, 8]
            targets: [native, cuda-sm90]
        """,
    "test_scons_tool": """\
        version: 1
        output_dir: out
        cache:
          dir: /tmp/cache
        models:
          - name: sig
            source: sig.onnx
            inputs: {x: [3, 5]}
            targets: [native]
            threads: 2
        """,
    "test_serve_updater": """\
        version: 1
        models:
          - {name: m, source: models/m.onnx}
        incremental: {enabled: true, diff_mode: syntactic, cache_ttl: 60, watch_paths: [extra]}
        """,
}

# A config the loader accepts (with m.onnx beside it), and mistakes made in it: (what, old, new).
BASE = """\
version: 1
output_dir: out
cache: {dir: cache, read_only: false}
defaults:
  threads: 2
models:
  - name: m
    source: m.onnx
    inputs: {x: [2, 4]}
    targets: [native]
    precision: fp32
    opt_level: 2
    disable_passes: [winograd]
    pass_options: {fuse_elementwise: {max_ops: 4}}
    symbol_prefix: m_
    link: both
    accuracy: {samples: 8, min_cosine: null}
    serve: {priority: high, deadline_ms: 100}
watch: {paths: [models], debounce_ms: 300}
incremental: {enabled: false, diff_mode: semantic}
executor: {kind: local}
"""
MISTAKES = [
    ("unknown top-level key", "output_dir: out", "output_dir: out\noutput_dirs: out2"),
    ("unknown model key", "    opt_level: 2", "    opt_level: 2\n    optimise: true"),
    ("unknown key in defaults", "  threads: 2", "  threads: 2\n  name: x"),
    ("string for an integer", "  threads: 2", '  threads: "2"'),
    ("float for an integer", "    opt_level: 2", "    opt_level: 2.5"),
    ("negative threads", "  threads: 2", "  threads: -1"),
    ("zero threads", "  threads: 2", "  threads: 0"),
    ("opt level out of range", "    opt_level: 2", "    opt_level: 4"),
    ("unknown target", "targets: [native]", "targets: [native, x86_64-avx1024]"),
    ("no target", "targets: [native]", "targets: []"),
    ("bad precision", "precision: fp32", "precision: fp8"),
    ("bad link", "link: both", "link: dynamic"),
    ("unknown pass", "disable_passes: [winograd]", "disable_passes: [winograd, fuse_everything]"),
    ("unknown pass in pass_options", "{fuse_elementwise: {max_ops: 4}}", "{fuse_everything: {}}"),
    ("unknown pass option", "{max_ops: 4}", "{max_opps: 4}"),
    ("pass option out of range", "{max_ops: 4}", "{max_ops: 1}"),
    ("options for a pass without any", "{fuse_elementwise: {max_ops: 4}}", "{fold_constants: {x: 1}}"),
    ("prefix not an identifier", "symbol_prefix: m_", "symbol_prefix: 1m_"),
    ("name not an identifier", "name: m", "name: my-model"),
    ("source of an unknown kind", "source: m.onnx", "source: m.tflite"),
    ("missing source", "    source: m.onnx\n", ""),
    ("missing version", "version: 1\n", ""),
    ("unsupported version", "version: 1", "version: 2"),
    ("no models", "models:\n  - name: m", "models: []\nother:\n  - name: m"),
    ("zero dimension", "x: [2, 4]", "x: [2, 0]"),
    ("zero batch bucket", "inputs: {x: [2, 4]}", "inputs: {x: [2, 4]}\n    batch: [1, 0]"),
    ("batch bucket not a list", "inputs: {x: [2, 4]}", "inputs: {x: [2, 4]}\n    batch: 8"),
    ("zero dimension in a bucket shape", "x: [2, 4]", "x: [[1, 4], [2, 0]]"),
    ("string dimension", "x: [2, 4]", 'x: [2, "4"]'),
    ("boolean dimension", "x: [2, 4]", "x: [2, true]"),
    ("string for a boolean", "read_only: false", 'read_only: "no"'),
    ("mapping expected", "cache: {dir: cache, read_only: false}", "cache: [cache]"),
    ("negative debounce", "debounce_ms: 300", "debounce_ms: -5"),
    ("bad priority", "priority: high", "priority: urgent"),
    ("zero deadline", "deadline_ms: 100", "deadline_ms: 0"),
    ("no samples", "samples: 8", "samples: 0"),
    ("cosine above 1", "min_cosine: null", "min_cosine: 2"),
    ("bad diff mode", "diff_mode: semantic", "diff_mode: fuzzy"),
    ("unknown executor", "executor: {kind: local}", "executor: {kind: ray}"),
    ("dask without an address", "executor: {kind: local}", "executor: {kind: dask}"),
    ("unknown executor key", "executor: {kind: local}", "executor: {kind: local, workers: 4}"),
]


@pytest.fixture(scope="module")
def validator():
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_errors(validator, text: str) -> list[str]:
    return [error.message for error in validator.iter_errors(yaml.safe_load(text))]


def test_cuvil_schema_prints_the_schema_in_docs(capsys):
    assert main(["schema"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed) == json_schema()
    assert SCHEMA_FILE.read_text() == printed, "docs/cuvil.schema.json is stale: cuvil schema > docs/cuvil.schema.json"


def test_example_points_editors_at_the_schema(validator):
    text = EXAMPLE_CONFIG.read_text()
    first = text.splitlines()[0]
    assert first == "# yaml-language-server: $schema=docs/cuvil.schema.json"
    assert (EXAMPLE_CONFIG.parent / first.split("$schema=")[1]).resolve() == SCHEMA_FILE
    assert schema_errors(validator, text) == []


def test_every_key_has_a_description():
    schema = json_schema()
    sections = [schema, *schema["$defs"].values()]
    missing = [f"{section.get('title')}.{key}" for section in sections
               for key, field in section["properties"].items() if not field.get("description")]
    assert missing == [] and all(section.get("description") for section in sections)


@pytest.mark.parametrize("where", sorted(WRITTEN))
def test_the_configs_the_tests_write_are_valid(validator, where):
    assert schema_errors(validator, textwrap.dedent(WRITTEN[where])) == []


def test_the_example_project_the_tests_build_is_valid(validator, tmp_path):
    config = write_example_project(tmp_path, extra_models=SECOND_MODEL)
    assert schema_errors(validator, config.read_text()) == []
    for link in ("static", "both"):
        text = config.read_text().replace("\n  link: shared\n", f"\n  link: {link}\n")
        assert schema_errors(validator, text) == []


@pytest.fixture
def write(tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"")

    def write(text):
        path = tmp_path / "cuvil.yaml"
        path.write_text(text)
        return path
    return write


def test_both_accept_the_base_config(validator, write):
    assert schema_errors(validator, BASE) == []
    assert load_config(write(BASE)).models[0].link == "both"


@pytest.mark.parametrize("what, old, new", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_schema_and_loader_reject_the_same_mistakes(validator, write, what, old, new):
    assert old in BASE, what
    text = BASE.replace(old, new, 1)
    assert schema_errors(validator, text), f"the schema accepts: {what}"
    with pytest.raises(ConfigError):
        load_config(write(text))


@pytest.mark.parametrize("inputs", ["inputs: {x: [2, 4]}\n    batch: [8, 1, 2]",
                                    "inputs: {x: [[1, 4], [2, 4], [8, 4]]}"])
def test_batch_buckets_in_either_form_are_valid(validator, write, inputs):
    text = BASE.replace("inputs: {x: [2, 4]}", inputs)
    assert schema_errors(validator, text) == []
    model = load_config(write(text)).models[0]
    assert model.batch == [1, 2, 8] and model.inputs == {"x": (8, 4)}


def test_bucket_shapes_differing_beyond_the_batch_are_refused(write):
    with pytest.raises(ConfigError, match="may differ in dim 0"):
        load_config(write(BASE.replace("inputs: {x: [2, 4]}", "inputs: {x: [[1, 4], [2, 5]]}")))
    with pytest.raises(ConfigError, match="not both"):
        load_config(write(BASE.replace("inputs: {x: [2, 4]}", "inputs: {x: [[1, 4], [2, 4]]}\n    batch: [1, 2]")))


def test_a_dask_executor_with_its_address_is_valid(validator, write):
    text = BASE.replace("executor: {kind: local}", "executor: {kind: dask, address: tcp://10.0.0.5:8786}")
    assert schema_errors(validator, text) == []
    assert load_config(write(text)).executor.address == "tcp://10.0.0.5:8786"


def test_cuvil_check_reports_a_mistake_the_schema_reports(write, capsys):
    path = write(BASE.replace("link: both", "link: dynamic"))
    assert main(["check", "-f", str(path)]) == 2
    assert "unknown link 'dynamic' (known: shared, static, both)" in capsys.readouterr().err
