"""Twelfth round: Triton's software pipeliner on the kernels' main loops.

A wrapper around Pallas-Triton's lowering (private jax API) sets `tt.num_stages` on the scf.for
loops of the named kernels, so that Triton's pipeliner issues their loads as asynchronous
copies (cp.async) into shared memory, stages - 1 iterations ahead (loops without a dot are
pipelined only when they carry that attribute)."""

from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering
from jax._src.pallas.triton import pallas_call_registration as reg
from kivi_jax.pallas_kernels.decode_attention.triton_stages import _mark_loops

STAGES = {}  # kernel module name (substring) -> tt.num_stages for its loops
LOG = []
_orig = lowering.lower_jaxpr_to_triton_module


def _staged(*args, **kwargs):
    res = _orig(*args, **kwargs)
    name = ir.StringAttr(res.module.operation.attributes["sym_name"]).value
    stages = next((v for k, v in STAGES.items() if k in name), None)
    if stages:
        with res.module.context:
            LOG.append((name, stages, _mark_loops(res.module, stages, ir)))
    return res


lowering.lower_jaxpr_to_triton_module = _staged
reg.lowering.lower_jaxpr_to_triton_module = _staged
