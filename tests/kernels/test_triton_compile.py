"""Every Triton kernel compiles for a real GPU, on a machine without one.

The interpreter accepts programs the GPU compiler rejects (a ``tl.dot`` under 16 rows, a non-constexpr shape,
tiles too big for shared memory), so a subprocess without ``TRITON_INTERPRET`` compiles each kernel for sm_80
(A100: the oldest target with bfloat16 tensor cores, and less shared memory than Hopper) down to a cubin with
the ptxas bundled in the triton wheel. The shapes are a Llama-8B-like layer's (head_dim 128, 16-token blocks)
in bfloat16, the production dtype; ``bench/gpu_check.sh`` runs the float32 variants natively.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SM80_MAX_SHARED = 166912  # bytes of shared memory one program may use on an A100
INDEX_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "slot_mapping_ptr"}
FLOAT_SCALARS = {"scale_log2e", "eps"}


def compile_all(arch: int) -> list[dict]:
    """Compile the kernels for ``arch``; one record per variant (run with ``TRITON_INTERPRET`` unset)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ksana.kernels.triton import activation, attention, cache, norm, rotary

    target = GPUTarget("cuda", arch, 32)
    attention_consts = {"BLOCK_SIZE": 16, "BLOCK_N": 64, "BLOCK_D": 128, "HAS_WINDOW": True}
    attention_consts |= {"COMPUTE_DTYPE": tl.bfloat16, "PRECISION": "tf32"}
    variants = [
        (attention._decode_kernel, "bf16", attention_consts | {"BLOCK_G": 16}, 4),
        (attention._prefill_kernel, "bf16", attention_consts | {"BLOCK_M": 64}, 8),
    ]
    variants += [
        (cache._store_kv_kernel, "bf16", {"BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128}, 4),
        (norm._rms_norm_kernel, "bf16", {"BLOCK_N": 8192, "HAS_RESIDUAL": True}, 16),
        (rotary._rotary_kernel, "bf16", {"BLOCK_H": 32, "BLOCK_HALF": 64, "IS_NEOX": False}, 4),
        (activation._silu_and_mul_kernel, "bf16", {"BLOCK": 1024}, 4),
    ]
    records = []
    for fn, dt, consts, num_warps in variants:
        signature = {}
        for name in fn.arg_names:
            if name in consts:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = "*i64" if name in INDEX_POINTERS else f"*{dt}"
            else:
                signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
        compiled = triton.compile(
            ASTSource(fn, signature, consts), target=target, options={"num_warps": num_warps}
        )
        records.append({"kernel": fn.__name__, "dtype": dt, "shared": compiled.metadata.shared})
    return records


def test_every_kernel_compiles_for_sm80(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cold cache: really compile
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    repo = str(Path(__file__).resolve().parents[2])  # the tests package, after site-packages
    code = (f"import sys; sys.path.append({repo!r}); import json, tests.kernels.test_triton_compile as t; "
            "print(json.dumps(t.compile_all(80)))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(done.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in records} == {
        "_decode_kernel",
        "_prefill_kernel",
        "_store_kv_kernel",
        "_rms_norm_kernel",
        "_rotary_kernel",
        "_silu_and_mul_kernel",
    }
    for r in records:
        assert r["shared"] <= SM80_MAX_SHARED, r
