"""cuvil.yaml loading: defaults merge, path resolution, and located errors.

Every error test checks the three things a user needs to fix the file: the
file name, the line of the offending key or value, and the key itself.
"""
import textwrap

import pytest

from cuvil.config import PRECISIONS, TARGETS, BuildSpec, ModelConfig, load_config, parse_config
from cuvil.errors import ConfigError, CuvilError

VALID = """\
version: 1
output_dir: out
cache:
  url: s3://bucket/prefix
defaults:
  targets: [native, x86_64-avx2]
  precision: fp16
  threads: 4
  symbol_prefix: shared_
models:
  - name: mlp
    source: models/mlp.onnx
    inputs:
      x: [1, 64]
    precision: fp32
    passes: [fold_constants]
  - name: conv
    source: models/conv.pt
    opt_level: 3
    symbol_prefix: null
watch:
  paths: [models, "*.yaml"]
  debounce_ms: 50
"""


@pytest.fixture
def project(tmp_path):
    """A project folder with the model files VALID names; returns a writer of cuvil.yaml."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mlp.onnx").write_bytes(b"")
    (tmp_path / "models" / "conv.pt").write_bytes(b"")

    def write(text):
        path = tmp_path / "cuvil.yaml"
        path.write_text(textwrap.dedent(text))
        return path
    return write


def load_error(path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value


def assert_located(error, path, line, *words):
    assert isinstance(error, CuvilError)
    assert error.file == path and error.line == line, str(error)
    first_line = str(error).splitlines()[0]
    assert first_line.startswith(f"{path}:{line}:"), first_line
    for word in words:
        assert word in str(error), (word, str(error))


def test_valid_config_merges_defaults_and_resolves_paths(project, tmp_path):
    path = project(VALID)
    spec = load_config(path)
    root = tmp_path.resolve()
    assert isinstance(spec, BuildSpec)
    assert spec.version == 1 and spec.path == root / "cuvil.yaml" and spec.root == root
    assert spec.output_dir == root / "out"
    assert spec.cache.dir == root / ".cuvil-cache"
    assert spec.cache.url == "s3://bucket/prefix" and spec.cache.read_only is False
    assert spec.watch.paths == [root / "models", root / "*.yaml"] and spec.watch.debounce_ms == 50

    mlp, conv = spec.models
    assert isinstance(mlp, ModelConfig)
    assert mlp.source == root / "models" / "mlp.onnx" and mlp.source.is_absolute()
    assert mlp.inputs == {"x": (1, 64)}
    assert mlp.precision == "fp32"  # the model's own key wins over defaults
    assert mlp.targets == ["native", "x86_64-avx2"] and mlp.threads == 4  # from defaults
    assert mlp.opt_level == 2 and mlp.disable_passes == []  # built-in defaults
    assert mlp.passes == ["fold_constants"] and conv.passes is None
    assert mlp.symbol_prefix == "shared_" and conv.symbol_prefix == "cuvil_"
    assert conv.precision == "fp16" and conv.opt_level == 3 and conv.inputs == {}
    assert (mlp.line, conv.line) == (11, 17)
    assert spec.model("conv") is conv


def test_minimal_config_gets_builtin_defaults(project, tmp_path):
    spec = parse_config("version: 1\nmodels:\n  - {name: mlp, source: models/mlp.onnx}\n",
                        project("").parent / "cuvil.yaml")
    (model,) = spec.models
    assert model.targets == ["native"] and model.precision == "fp32" and model.threads == 1
    assert model.symbol_prefix == "cuvil_"
    assert spec.output_dir == tmp_path.resolve() / "build" / "cuvil"
    assert spec.watch.paths == [] and spec.watch.debounce_ms == 300
    assert "native" in TARGETS and "int4" in PRECISIONS


def test_missing_file_names_it_and_points_to_the_example(tmp_path):
    error = load_error(tmp_path / "cuvil.yaml")
    assert "cuvil.yaml" in str(error) and "cuvil.yaml.example" in error.hint


def test_malformed_yaml_is_located(project):
    path = project("""\
        version: 1
        models:
          - name: mlp
            source: [unclosed
        """)
    error = load_error(path)
    assert_located(error, path, 5, "invalid YAML")


def test_python_tags_are_refused(project):
    path = project("""\
        version: 1
        models: !!python/object/apply:os.system ["echo pwned"]
        """)
    assert_located(load_error(path), path, 2, "python/object")


def test_duplicate_yaml_key(project):
    path = project("""\
        version: 1
        models:
          - name: mlp
            source: models/mlp.onnx
            threads: 2
            threads: 3
        """)
    assert_located(load_error(path), path, 6, "duplicate key 'threads'", "line 5")


def test_unknown_target_points_at_the_value(project):
    path = project("""\
        version: 1
        models:
          - name: mlp
            source: models/mlp.onnx
            targets:
              - native
              - x86_64-sse
        """)
    error = load_error(path)
    assert_located(error, path, 7, "models[0].targets[1]", "unknown target 'x86_64-sse'", "x86_64-avx512")
    assert error.column == 9


def test_unknown_key_lists_the_allowed_ones(project):
    path = project("""\
        version: 1
        models:
          - name: mlp
            source: models/mlp.onnx
            precison: fp16
        """)
    assert_located(load_error(path), path, 5, "unknown key 'precison' in models[0]", "precision", "opt_level")


def test_unknown_top_level_key(project):
    path = project("version: 1\nmodel: []\nmodels:\n  - {name: mlp, source: models/mlp.onnx}\n")
    assert_located(load_error(path), path, 2, "unknown key 'model' in the top level", "output_dir")


def test_wrong_type_says_what_was_expected(project):
    path = project("""\
        version: 1
        defaults:
          threads: "4"
        models:
          - {name: mlp, source: models/mlp.onnx}
        """)
    assert_located(load_error(path), path, 3, "defaults.threads", "valid integer", "'4'")


def test_out_of_range_and_bad_precision(project):
    path = project("""\
        version: 1
        models:
          - name: mlp
            source: models/mlp.onnx
            opt_level: 7
            precision: fp8
        """)
    error = load_error(path)
    assert_located(error, path, 5, "models[0].opt_level", "3")
    assert "unknown precision 'fp8'" in str(error) and "cuvil.yaml:6:" in str(error)


def test_unsupported_version(project):
    path = project("version: 2\nmodels:\n  - {name: mlp, source: models/mlp.onnx}\n")
    assert_located(load_error(path), path, 1, "version", "unsupported version 2")


def test_missing_required_key(project):
    path = project("version: 1\nmodels:\n  - name: mlp\n    inputs: {}\n")
    assert_located(load_error(path), path, 3, "missing required key 'source' in models[0]")


@pytest.mark.parametrize("dims, bad", [("[1, 0]", "0"), ("[-3]", "-3"), ("[2.5]", "2.5"),
                                       ("[true]", "True"), ('["n"]', "'n'")])
def test_bad_shape(project, dims, bad):
    path = project(f"""\
        version: 1
        models:
          - name: mlp
            source: models/mlp.onnx
            inputs:
              x: {dims}
        """)
    assert_located(load_error(path), path, 6, "models[0].inputs.x", "positive integers", f"got {bad}")


def test_empty_models_list(project):
    path = project("version: 1\nmodels: []\n")
    assert_located(load_error(path), path, 2, "models", "at least one model")
    path = project("version: 1\nmodels:\n")
    assert_located(load_error(path), path, 2, "at least one model")


def test_duplicate_model_names(project):
    path = project("""\
        version: 1
        models:
          - name: mlp
            source: models/mlp.onnx
          - name: mlp
            source: models/conv.pt
        """)
    assert_located(load_error(path), path, 5, "models[1].name", "duplicate model name 'mlp'", "line 3")


def test_missing_source_file(project):
    path = project("""\
        version: 1
        models:
          - name: mlp
            source: models/absent.onnx
        """)
    assert_located(load_error(path), path, 4, "models[0].source", "absent.onnx", "not found")


def test_bad_source_suffix_and_identifier(project):
    path = project("""\
        version: 1
        models:
          - name: my-model
            source: models/mlp.txt
        """)
    error = load_error(path)
    assert_located(error, path, 3, "models[0].name", "'my-model' is not an identifier")
    assert "cuvil.yaml:4:" in str(error) and ".onnx" in str(error)


def test_empty_file_and_non_mapping(project):
    path = project("")
    error = load_error(path)
    assert error.file == path and "empty" in str(error)
    path = project("- version: 1\n")
    assert_located(load_error(path), path, 1, "expected a mapping")


def test_parse_config_uses_path_for_messages_and_base(project, tmp_path):
    project("")
    with pytest.raises(ConfigError) as info:
        parse_config("version: 1\nmodels:\n  - {name: mlp, source: nowhere.onnx}\n", tmp_path / "other.yaml")
    assert "other.yaml:3:" in str(info.value) and str(tmp_path.resolve() / "nowhere.onnx") in str(info.value)


def test_unknown_model_name_lists_known_ones(project):
    spec = load_config(project(VALID))
    with pytest.raises(ConfigError) as info:
        spec.model("resnet")
    assert "'resnet'" in str(info.value) and "mlp, conv" in str(info.value)
