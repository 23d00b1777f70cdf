"""If, Loop and Scan whose control is known at build time become straight-line code.

An If whose condition is a constant is replaced by the nodes of the branch it
takes; an If decided at run time computes both branches and selects with Where
(when both give the same shapes); a Loop with a constant trip count (and a condition that folds to a
constant every iteration) and a Scan over a static sequence are unrolled. A Loop whose trip count or
condition is known only at run time is compiled as a loop: its body is imported once between a
LoopBegin and a LoopEnd node (domain "cuvil"; backends/numba_cpu/control.py). The
body's nodes are copied with their names prefixed per iteration and handed
back to the importer one by one, so constants keep folding through them and
nested control flow is inlined the same way. Other control that depends on
run-time data is an UnsupportedOpError naming the node.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..errors import UnsupportedOpError
from ..ir import Node, Value
from ..ops import FUSED_DOMAIN

# Loops run at most this many iterations at build time (each one copies the body).
_MAX_UNROLL = 4096


def _subgraph(proto, key):
    for attr in proto.attribute:
        if attr.name == key:
            return attr.g
    raise UnsupportedOpError(f"node '{proto.name}' ({proto.op_type}) has no '{key}' subgraph")


def _int_attr(proto, key, default):
    for attr in proto.attribute:
        if attr.name == key:
            return helper.get_attribute_value(attr)
    return default


class Inliner:
    """Inlines control-flow nodes for an importer that provides `values`,
    `import_node(proto)`, `add_constant(name, array)` and `tensor_to_array(tensor)`."""

    def __init__(self, importer):
        self.imp = importer

    def _structured(self, name) -> bool:
        """Whether `name` is a sequence or an optional (frontends/sequences.py), not a tensor."""
        seqs = getattr(self.imp, "seqs", None)
        return seqs is not None and seqs.defines(name)

    def _fresh(self, base):
        name, i = base, 0
        while name in self.imp.values or self._structured(name):
            i += 1
            name = f"{base}~{i}"
        return name

    def _const(self, base, array):
        name = self._fresh(base)
        self.imp.add_constant(name, np.asarray(array))
        return name

    def _emit(self, op, inputs, outputs, name, **attrs):
        self.imp.import_node(helper.make_node(op, inputs, outputs, name=name, **attrs))

    def run_body(self, graph: onnx.GraphProto, prefix: str, bindings: dict) -> list[str]:
        """Import the body's nodes with inner names prefixed; returns the outer names of its outputs."""
        local = {}
        for tensor in graph.initializer:
            local[tensor.name] = self._const(prefix + tensor.name, self.imp.tensor_to_array(tensor))
        for node in graph.node:
            for out in node.output:
                if out:
                    local[out] = self._fresh(prefix + out)

        # Names this body defines, seen by the bodies nested in it too (an If inside an If
        # branch reads values of the outer branch by their names in that branch).
        scopes = self.imp.__dict__.setdefault("inline_scopes", [])
        scopes.append({**local, **bindings})

        def rename(name):
            if not name:
                return name
            for scope in reversed(scopes):
                if name in scope:
                    return scope[name]
            return name  # a value of the main graph

        try:
            for node in graph.node:
                copy = onnx.NodeProto()
                copy.CopyFrom(node)
                del copy.input[:]
                del copy.output[:]
                copy.input.extend(rename(i) for i in node.input)
                copy.output.extend(local.get(o, "") if o else "" for o in node.output)
                copy.name = prefix + (node.name or node.op_type)
                self.imp.import_node(copy)
            return [rename(o.name) for o in graph.output]
        finally:
            scopes.pop()

    def _bind(self, results: list[str], outer: list[str], name: str):
        for inner, out in zip(results, outer):
            if out:
                self._emit("Identity", [inner], [out], f"{name}/result:{out}")

    # -- If ---------------------------------------------------------------------------
    def inline_if(self, proto, name):
        cond = self.imp.values.get(proto.input[0])
        if cond is None:
            raise UnsupportedOpError(f"node '{name}' (If): its condition '{proto.input[0]}' is not defined")
        if not cond.is_const:
            self._select_if(proto, name, cond)
            return
        branch = _subgraph(proto, "then_branch" if bool(np.asarray(cond.data).reshape(-1)[0]) else "else_branch")
        self._bind(self.run_body(branch, f"{name}/", {}), list(proto.output), name)

    def _select_if(self, proto, name, cond):
        """An If decided at run time: both branches are computed and Where picks one result.
        ONNX branches are pure, so this is exact; it costs the branch not taken. It needs each
        output to have the same shape and dtype in both branches (Where must not broadcast)."""
        if cond.size != 1:
            raise UnsupportedOpError(f"node '{name}' (If): its condition has {cond.size} elements, not 1")
        then = self.run_body(_subgraph(proto, "then_branch"), f"{name}/then/", {})
        other = self.run_body(_subgraph(proto, "else_branch"), f"{name}/else/", {})
        # sequences / optionals: selected element by element when both branches give the same
        # structure (frontends/sequences.py); their tensors are then checked like any output below
        pairs = []
        for out, a, b in zip(proto.output, then, other):
            if self._structured(a) or self._structured(b):
                pairs.extend(self.imp.seqs.paired_elements(name, out, a, b))
            else:
                pairs.append((out, a, b))
        for out, a, b in pairs:
            va, vb = self.imp.values[a], self.imp.values[b]
            if tuple(va.shape) != tuple(vb.shape) or np.dtype(va.dtype) != np.dtype(vb.dtype):
                raise UnsupportedOpError(
                    f"node '{name}' (If): its condition is only known at run time and output '{out}' is "
                    f"{np.dtype(va.dtype)}{list(va.shape)} in one branch, {np.dtype(vb.dtype)}{list(vb.shape)} "
                    f"in the other", hint="cuvil compiles a run-time If when both branches give outputs of "
                                          "the same shapes; or make the condition known at build time")
        scalar = self._fresh(f"{name}/cond")
        self._emit("Reshape", [proto.input[0], self._const(f"{name}/scalar", np.zeros(0, np.int64))], [scalar],
                   f"{name}/cond_scalar")
        for out, a, b in pairs:
            if out:
                self._emit("Where", [scalar, a, b], [out], f"{name}/select:{out}")

    # -- Loop -------------------------------------------------------------------------
    def inline_loop(self, proto, name):
        inputs = list(proto.input) + [""] * 2
        trip, cond = inputs[0], inputs[1]
        carried = [i for i in proto.input[2:]]
        body = _subgraph(proto, "body")
        if not trip and not cond:
            raise UnsupportedOpError(f"node '{name}' (Loop): it has neither a trip count nor a condition")
        if (trip and not self.imp.values[trip].is_const) or (cond and not self.imp.values[cond].is_const):
            structured = [c for c in carried if self._structured(c)]
            if structured:
                raise UnsupportedOpError(f"node '{name}' (Loop): its trip count or condition is known only at run "
                                         f"time and it carries a sequence or an optional ({', '.join(structured)}), "
                                         "whose length cuvil fixes at build time",
                                         hint="make the trip count and condition known at build time (the loop is "
                                              "then unrolled)")
            self._compiled_loop(proto, name, trip, cond, carried, body)
            return
        if not trip and not cond:
            raise UnsupportedOpError(f"node '{name}' (Loop): it has neither a trip count nor a condition")
        # No trip count (or a huge one, as tf.while_loop's converters write): the loop runs while its
        # condition, folded at build time every iteration, holds; it must stop within the limit.
        count = int(np.asarray(self.imp.values[trip].data).reshape(-1)[0]) if trip else None
        if count is not None and count > _MAX_UNROLL and not cond:
            raise UnsupportedOpError(f"node '{name}' (Loop): {count} iterations is too many to unroll "
                                     f"(limit {_MAX_UNROLL})")
        bounded = count is not None and count <= _MAX_UNROLL
        if not bounded:
            count = _MAX_UNROLL + 1
        keep_going = True
        if cond:
            value = self.imp.values[cond]
            if not value.is_const:
                raise UnsupportedOpError(f"node '{name}' (Loop): its condition is only known at run time")
            keep_going = bool(np.asarray(value.data).reshape(-1)[0])
        n_carried = len(carried)
        body_inputs = [i.name for i in body.input]
        scans: list[list[str]] = [[] for _ in range(len(body.output) - 1 - n_carried)]
        state = carried
        for i in range(count):
            if not keep_going:
                break
            bindings = {body_inputs[0]: self._const(f"{name}/iter{i}/i", np.array(i, np.int64))}
            if len(body_inputs) > 1:
                bindings[body_inputs[1]] = self._const(f"{name}/iter{i}/cond", np.array(True))
            bindings.update(zip(body_inputs[2:], state))
            results = self.run_body(body, f"{name}/iter{i}/", bindings)
            cond_out = self.imp.values[results[0]]
            if not cond_out.is_const:
                raise UnsupportedOpError(f"node '{name}' (Loop): its condition depends on run-time data")
            keep_going = bool(np.asarray(cond_out.data).reshape(-1)[0])
            state = results[1:1 + n_carried]
            for k, value in enumerate(results[1 + n_carried:]):
                scans[k].append(value)
        if keep_going and not bounded:
            raise UnsupportedOpError(f"node '{name}' (Loop): its condition still holds after {_MAX_UNROLL} "
                                     f"iterations; too many to unroll")
        self._bind(state, list(proto.output[:n_carried]), name)
        for k, (parts, out) in enumerate(zip(scans, proto.output[n_carried:])):
            self._stack(parts, out, 0, f"{name}/scan{k}")

    def _compiled_loop(self, proto, name, trip, cond, carried, body):
        """A Loop whose trip count or condition is known only at run time, compiled as a loop:
        LoopBegin, the body's nodes imported once, LoopEnd (backends/numba_cpu/control.py). Its
        state keeps its shapes and dtypes from one iteration to the next."""
        n = len(carried)
        if len(body.output) - 1 - n:
            raise UnsupportedOpError(f"node '{name}' (Loop): its trip count or condition is known only at run "
                                     f"time, and it has {len(body.output) - 1 - n} scan output(s), whose length "
                                     "would depend on the data",
                                     hint="return the loop's state only, or make the trip count and condition "
                                          "known at build time (the loop is then unrolled)")
        for what, value in (("trip count", trip), ("condition", cond)):
            if value and self.imp.values[value].size != 1:
                raise UnsupportedOpError(f"node '{name}' (Loop): its {what} '{value}' has "
                                         f"{self.imp.values[value].size} elements, not 1")
        loop = self.imp.__dict__.setdefault("loop_count", 0)
        self.imp.loop_count = loop + 1
        iteration = self._fresh(f"{name}/iteration")
        cond_in = self._fresh(f"{name}/cond_in")
        self.imp.values[iteration] = Value(iteration, np.dtype(np.int64), ())
        self.imp.values[cond_in] = Value(cond_in, np.dtype(np.bool_), ())
        states = []
        for k, init in enumerate(carried):
            state = self._fresh(f"{name}/state{k}")
            v = self.imp.values[init]
            self.imp.values[state] = Value(state, np.dtype(v.dtype), tuple(v.shape))
            states.append(state)
        self.imp.add_node(Node("LoopBegin", f"{name}/begin", [trip or "", cond or "", *carried],
                               [iteration, cond_in, *states], {"loop": loop}, FUSED_DOMAIN))
        body_inputs = [i.name for i in body.input]
        bindings = dict(zip(body_inputs, [iteration, cond_in, *states]))
        results = self.run_body(body, f"{name}/body/", bindings)
        cond_out, outs = results[0], results[1:1 + n]
        for k, (state, out) in enumerate(zip(states, outs)):
            a, b = self.imp.values[state], self.imp.values[out]
            if tuple(a.shape) != tuple(b.shape) or np.dtype(a.dtype) != np.dtype(b.dtype):
                raise UnsupportedOpError(
                    f"node '{name}' (Loop): its state {k} ('{carried[k]}') is {np.dtype(a.dtype)}{list(a.shape)} "
                    f"before an iteration and {np.dtype(b.dtype)}{list(b.shape)} after it",
                    hint="a loop decided at run time must keep the shapes of its state")
        finals = []
        for k, out in enumerate(list(proto.output[:n]) + [""] * (n - len(proto.output[:n]))):
            final = out or self._fresh(f"{name}/final{k}")
            v = self.imp.values[states[k]]
            self.imp.values[final] = Value(final, np.dtype(v.dtype), tuple(v.shape))
            finals.append(final)
        self.imp.add_node(Node("LoopEnd", f"{name}/end", [cond_out if cond else "", *outs, iteration, cond_in,
                                                           *states], finals, {"loop": loop}, FUSED_DOMAIN))

    def _stack(self, parts, out, axis, name):
        if not parts:
            raise UnsupportedOpError(f"node '{name}': a scan output with no iterations is not supported")
        opset = self.imp.opsets.get("", self.imp.opsets.get("ai.onnx", 0))
        axes = self._const(f"{name}/axes", np.array([axis], np.int64)) if opset >= 13 else None
        expanded = []
        for j, part in enumerate(parts):
            tmp = self._fresh(f"{name}/item{j}")
            if axes is None:  # before opset 13 Unsqueeze takes its axes as an attribute
                self._emit("Unsqueeze", [part], [tmp], f"{name}/unsqueeze{j}", axes=[axis])
            else:
                self._emit("Unsqueeze", [part, axes], [tmp], f"{name}/unsqueeze{j}")
            expanded.append(tmp)
        self._emit("Concat", expanded, [out], f"{name}/concat", axis=axis)

    # -- Scan -------------------------------------------------------------------------
    def inline_scan(self, proto, name):
        if self.imp.opsets.get("", self.imp.opsets.get("ai.onnx", 0)) < 9:
            self._scan8(proto, name)
            return
        self._scan9(proto, name)

    def _scan8(self, proto, name):
        """Scan-8: states and scan inputs have a batch axis 0 (the scan axis is 1) and an optional
        sequence_lens first input. Each batch row is the Scan-9 of that row's slices (one Gather
        each), and the results are stacked back along axis 0."""
        n_scan = _int_attr(proto, "num_scan_inputs", 0)
        lens = proto.input[0] if proto.input else ""
        states = list(proto.input[1:len(proto.input) - n_scan])
        scans = list(proto.input[len(proto.input) - n_scan:])
        if not scans:
            raise UnsupportedOpError(f"node '{name}' (Scan): no scan inputs")
        batch, length = self.imp.values[scans[0]].shape[:2]
        if lens:
            value = self.imp.values[lens]
            if not value.is_const or np.any(np.asarray(value.data) != length):
                raise UnsupportedOpError(f"node '{name}' (Scan-8): sequence_lens '{lens}' shorter than the scan "
                                         f"axis ({length}) or known only at run time",
                                         hint="give every row the full length, or export at opset >= 9")
        directions = list(_int_attr(proto, "directions", [0] * n_scan))
        outs: list[list[str]] = [[] for _ in proto.output]
        for b in range(batch):
            index = self._const(f"{name}/b{b}/index", np.array(b, np.int64))
            rows = []
            for k, src in enumerate(states + scans):
                rows.append(self._fresh(f"{name}/b{b}/row{k}"))
                self._emit("Gather", [src, index], [rows[-1]], f"{name}/b{b}/gather{k}", axis=0)
            results = [self._fresh(f"{name}/b{b}/out{k}") for k in range(len(proto.output))]
            row_scan = helper.make_node("Scan", rows, results, name=f"{name}/b{b}", num_scan_inputs=n_scan,
                                        scan_input_directions=directions)
            row_scan.attribute.extend(a for a in proto.attribute if a.name == "body")
            self._scan9(row_scan, f"{name}/b{b}")
            for k, value in enumerate(results):
                outs[k].append(value)
        for k, (parts, out) in enumerate(zip(outs, proto.output)):
            if out:
                self._stack(parts, out, 0, f"{name}/batch{k}")

    def _scan9(self, proto, name):
        body = _subgraph(proto, "body")
        n_scan = _int_attr(proto, "num_scan_inputs", 0)
        states = list(proto.input[:len(proto.input) - n_scan])
        scan_inputs = list(proto.input[len(proto.input) - n_scan:])
        in_axes = list(_int_attr(proto, "scan_input_axes", [0] * n_scan))
        in_dirs = list(_int_attr(proto, "scan_input_directions", [0] * n_scan))
        n_out = len(body.output) - len(states)
        out_axes = list(_int_attr(proto, "scan_output_axes", [0] * n_out))
        out_dirs = list(_int_attr(proto, "scan_output_directions", [0] * n_out))
        if not scan_inputs:
            raise UnsupportedOpError(f"node '{name}' (Scan): no scan inputs")
        ranks = [len(self.imp.values[s].shape) for s in scan_inputs]
        in_axes = [a % r for a, r in zip(in_axes, ranks)]
        length = self.imp.values[scan_inputs[0]].shape[in_axes[0]]
        body_inputs = [i.name for i in body.input]
        outs: list[list[str]] = [[] for _ in range(n_out)]
        for t in range(length):
            bindings = dict(zip(body_inputs, states))
            for k, (src, axis, direction) in enumerate(zip(scan_inputs, in_axes, in_dirs)):
                index = self._const(f"{name}/t{t}/index{k}", np.array(length - 1 - t if direction else t, np.int64))
                item = self._fresh(f"{name}/t{t}/in{k}")
                self._emit("Gather", [src, index], [item], f"{name}/t{t}/gather{k}", axis=axis)
                bindings[body_inputs[len(states) + k]] = item
            results = self.run_body(body, f"{name}/t{t}/", bindings)
            states = results[:len(states)]
            for k, value in enumerate(results[len(states):]):
                outs[k].append(value)
        self._bind(states, list(proto.output[:len(states)]), name)
        for k, out in enumerate(proto.output[len(states):]):
            if not out:
                continue
            parts = outs[k][::-1] if out_dirs[k] else outs[k]
            rank = len(self.imp.values[parts[0]].shape) + 1
            self._stack(parts, out, out_axes[k] % rank, f"{name}/out{k}")
