"""Compiled for sm_90 on any machine (Triton's own ptxas, no GPU): the float operations of exact
mode's kernels, per source line, must not depend on the variant a path compiles. Run by
test_exact_triton.py in a process without TRITON_INTERPRET; prints one JSON line."""

import collections
import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rlcu.ops import attention_exact as ae
from rlcu.ops import logprob as lpm

_FLOAT = re.compile(r"\s*((?:mul|add|sub|fma|ex2|lg2|max|min|div|rcp|neg|mma|cvt)[a-z0-9._]*(?:f32|bf16)[a-z0-9._]*)")


def _ptx(fn, sig, const, warps, stages):
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig.get(n, "").startswith("*") or n.startswith("stride")}
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages}).asm["ptx"]


def float_ops(ptx: str) -> dict:
    """{source line: Counter of float instructions}, from the .loc annotations of the PTX."""
    out, cur = collections.defaultdict(collections.Counter), None
    for line in ptx.splitlines():
        m = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)\s+\d+", line)
        if m:
            cur = (int(m.group(1)), int(m.group(2)))
        elif cur is not None and (m := _FLOAT.match(line)):
            out[cur][m.group(1)] += 1
    return out


def main():
    attn = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "BLOCK_TABLES": "*i32",
            "CU_Q": "*i32", "SEQ_LENS": "*i32", "N_LSE": "i32", "scale_log2": "fp32",
            **{f"stride_{s}": "i32" for s in ("qn", "qh", "kn", "kh", "vn", "vh", "bt", "on", "oh")}}
    base = {"G": 2, "BM": 16, "BMT": 8, "D": 128, "BD": 128, "BS": 16, "BN": 64, "BY_SUM": False, "WITH_LSE": False}
    decode = float_ops(_ptx(ae._attn_exact_kernel, attn, {**base, "PAGED": True, "SUB": 1}, 4, 2))
    train1 = float_ops(_ptx(ae._attn_exact_kernel, attn, {**base, "PAGED": False, "SUB": 1}, 4, 2))
    # SUB sub-tiles sharing a key tile: each runs a lone sub-tile's instructions, SUB times over
    train4 = float_ops(_ptx(ae._attn_exact_kernel, attn, {**base, "PAGED": False, "SUB": 4}, 4, 2))
    prefill2 = float_ops(_ptx(ae._attn_exact_kernel, attn, {**base, "PAGED": True, "SUB": 2}, 4, 2))
    def times(ops, n):
        return {k: collections.Counter({i: n * c for i, c in v.items()}) for k, v in ops.items()}

    head = {"Z": "*bf16", "Tgt": "*i64", "Lp": "*fp32", "Ent": "*fp32", "Lse": "*fp32", "stride_z": "i32",
            "scale2": "fp32", "TEMP": "*fp32"}
    kw = {"V": 151936, "BV": 8192, "ROW_T": True}
    plain = float_ops(_ptx(lpm._logprob_fwd_kernel, head, {**kw, "WITH_ENT": False}, 8, 1))
    ent = float_ops(_ptx(lpm._logprob_fwd_kernel, head, {**kw, "WITH_ENT": True}, 8, 1))
    # the head: every line of the kernel's own file that the plain variant (lse and lp) compiles
    # compiles the same with the entropy on; in Triton's library lines (the row sums' combine,
    # shared by every tl.sum) the entropy's second sum comes on top of the plain one
    own = {f for f, ln in plain if ln == _line(lpm, "s = s * alpha + tl.sum(p, 0)")}
    differs = {f"{k}": (dict(plain[k]), dict(ent.get(k, {}))) for k in plain if k[0] in own and plain[k] != ent.get(k)}
    not_within = [f"{k}" for k in plain if k[0] not in own and plain[k] - ent.get(k, collections.Counter())]
    print(json.dumps({"attention_equal": train1 == decode and train4 == times(decode, 4)
                      and prefill2 == times(decode, 2),
                      "attention_lines": len(decode), "head_lines": len(plain),
                      "head_own_file": sorted(own), "head_differs": differs, "head_not_within": not_within}))


def _line(module, text: str) -> int:
    with open(module.__file__) as f:
        lines = f.read().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if text in line)


if __name__ == "__main__":
    main()
