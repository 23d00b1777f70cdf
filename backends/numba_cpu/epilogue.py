"""Fused epilogues of GEMM and convolution kernels: `y = act(op(...) + residual)`.

The fused ops live in the "cuvil" domain (made by the fusion passes):

    FusedConv / FusedGemm / FusedMatMul: the attributes of Conv / Gemm / MatMul, plus
      activation         str: "", "Relu", "Clip", "Sigmoid", "HardSwish", "HardSigmoid", "LeakyRelu", "Tanh"
      activation_params  floats: Clip [min, max], LeakyRelu [alpha], HardSigmoid [alpha, beta]; [] otherwise
      has_residual       int 0/1: when 1, the LAST input is added (broadcast to the output) before the activation

`Epilogue.expr(x)` is the activation as an expression over a variable, for the
kernels' output loops (where the value is still in registers or in L1).
"""
from __future__ import annotations

from dataclasses import dataclass

from cuvil.errors import UnsupportedOpError
from cuvil.ops import EPILOGUE_ACTIVATIONS as _FUSED_ACTIVATIONS, REGISTER_ACTIVATIONS

from .kernel import literal

ACTIVATIONS = ("",) + _FUSED_ACTIVATIONS
EPILOGUE_ACTIVATIONS = ("",) + REGISTER_ACTIVATIONS   # what the micro-kernel computes in registers


@dataclass(frozen=True)
class Epilogue:
    activation: str = ""
    params: tuple = ()
    residual: str | None = None   # value name of the residual operand (the node's last input)

    @property
    def active(self) -> bool:
        return bool(self.activation)

    def expr(self, x: str, dtype) -> str:
        """The activation applied to variable `x` (a plain name: it may appear several times)."""
        F = lambda v: literal(v, dtype)
        act, p = self.activation, self.params
        if act == "":
            return x
        if act == "Relu":
            return f"max({x}, {F(0)})"
        if act == "Clip":
            lo, hi = p
            return f"min(max({x}, {F(lo)}), {F(hi)})"
        if act == "LeakyRelu":
            return f"({x} if {x} >= {F(0)} else {x} * {F(p[0])})"
        if act == "HardSigmoid":
            return f"min(max({x} * {F(p[0])} + {F(p[1])}, {F(0)}), {F(1)})"
        if act == "HardSwish":
            return f"{x} * min(max({x} * {F(1 / 6)} + {F(0.5)}, {F(0)}), {F(1)})"
        if act == "Sigmoid":
            return f"vsigmoid({x})"
        if act == "Tanh":
            return f"vtanh({x})"
        raise AssertionError(act)


def register_epilogue(row_bias: bool, epilogue: Epilogue, other_terms: bool = False) -> dict | None:
    """The micro-kernel spec fields (backends/numba_cpu/ukernel.py UKSpec) that compute the epilogue
    in registers on the last pass: a per-row bias and a Relu or Clip. None when there is nothing
    to compute or it needs the loop over the stored tile (`other_terms`: a residual, a bias the
    micro-kernel cannot add; or another activation)."""
    if other_terms or epilogue.activation not in EPILOGUE_ACTIVATIONS or not (row_bias or epilogue.active):
        return None
    return {"bias": int(row_bias), **register_activation(epilogue)}


def register_activation(epilogue: Epilogue) -> dict:
    """The spec fields (act, act_lo, act_hi) of a Relu or Clip computed in registers."""
    assert epilogue.activation in EPILOGUE_ACTIVATIONS, epilogue.activation
    lo, hi = epilogue.params if epilogue.activation == "Clip" else (0.0, 0.0)
    return {"act": epilogue.activation, "act_lo": float(lo), "act_hi": float(hi)}


def epilogue_of(node) -> tuple[Epilogue, list[str]]:
    """The node's epilogue and its inputs without the residual (Conv/Gemm/MatMul inputs)."""
    inputs = list(node.inputs)
    if node.domain != "cuvil":
        return Epilogue(), inputs
    act = node.attr("activation", "") or ""
    if isinstance(act, bytes):
        act = act.decode()
    if act not in ACTIVATIONS:
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): activation '{act}' is not supported",
                                 hint=f"supported: {', '.join(a for a in ACTIVATIONS if a)}")
    params = tuple(float(v) for v in (node.attr("activation_params") or ()))
    defaults = {"Clip": None, "LeakyRelu": (0.01,), "HardSigmoid": (0.2, 0.5)}
    need = {"Clip": 2, "LeakyRelu": 1, "HardSigmoid": 2}.get(act, 0)
    if len(params) != need:
        if not params and defaults.get(act):
            params = defaults[act]
        elif act == "Clip" and len(params) < 2:
            # a missing bound is no bound
            lo = params[0] if params else float("-inf")
            params = (lo, float("inf"))
        else:
            raise UnsupportedOpError(f"node '{node.name}' ({node.op}): activation {act} takes {need} "
                                     f"activation_params, got {len(params)}")
    residual = None
    if int(node.attr("has_residual", 0)):
        if not inputs or not inputs[-1]:
            raise UnsupportedOpError(f"node '{node.name}' ({node.op}): has_residual=1 but no residual input")
        residual = inputs.pop()
    return Epilogue(act, params, residual), inputs
