"""Triton's software pipeliner for loops without a dot (Pallas-Triton, through private jax API).

Triton pipelines a loop's loads (`cp.async` copies into shared memory, issued stages - 1
iterations ahead, holding no registers while in flight) where they feed a dot, and in loops
without a dot only where the loop carries a ``tt.num_stages`` attribute (Triton's
``AssignLatencies`` pass). Pallas-Triton sets no such attribute, so the kernels' own loops
would keep their tiles in flight in registers (``loops.pipelined_loop``). Here a kernel whose
name ends in ``_stagesN`` (`staged_name`) gets ``tt.num_stages = N`` on every ``scf.for`` of
its Triton module: `install` wraps Pallas-Triton's lowering,
``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module`` (the same function in jax
0.10.2 and 0.11.2, on whose result the module is then marked). Only such names are touched.

Where that function is missing (another jax version), `install` returns False and the kernels
keep their register prefetch, with a warning.
"""

from __future__ import annotations

import functools
import re
import warnings

_SUFFIX = re.compile(r"_stages(\d+)$")


def staged_name(name: str, stages: int) -> str:
    """The kernel name that asks for `stages` pipeline stages on its loops."""
    return f"{name}_stages{stages}"


def _mark_loops(module, stages: int, ir) -> int:
    """Sets tt.num_stages on every scf.for of `module`; returns how many it marked."""
    attr = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), stages)
    marked = []

    def visit(op):
        if op.name == "scf.for":
            op.attributes["tt.num_stages"] = attr
            marked.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return len(marked)


def install() -> bool:
    """Wraps Pallas-Triton's lowering (again, if something replaced the wrapper since); False,
    with a warning, where jax lacks the hook."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering

        lower = lowering.lower_jaxpr_to_triton_module
        ir.WalkResult.ADVANCE  # noqa: B018  (the walk API the marking needs)
    except (ImportError, AttributeError) as e:
        _warn_unavailable(repr(e))
        return False
    if getattr(lower, "marks_loop_stages", False):
        return True

    @functools.wraps(lower)
    def lower_and_mark(*args, **kwargs):
        result = lower(*args, **kwargs)
        module = result.module
        name = ir.StringAttr(module.operation.attributes["sym_name"]).value
        if m := _SUFFIX.search(name):
            with module.context:
                if not _mark_loops(module, int(m.group(1)), ir):
                    raise ValueError(f"kernel {name} asks for pipeline stages but has no loop")
        return result

    lower_and_mark.marks_loop_stages = True
    lowering.lower_jaxpr_to_triton_module = lower_and_mark
    return True


@functools.cache
def _warn_unavailable(why: str) -> None:
    warnings.warn(
        f"kivi_jax: Triton loop pipelining unavailable in this jax ({why}); the decode kernels "
        "prefetch in registers instead (a slower score kernel)",
        stacklevel=3,
    )
