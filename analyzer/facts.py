"""The analyzer's vocabulary: every name of the `main_grad` contract the rules and the syntax gate look for.

One definition each, imported by the libcst rules (`maingrad.analyzer.rules.*`), their shared helpers
(`rules/_common.py`) and the `ast` syntax gate (`maingrad.analyzer.syntax_index`). A gate must
over-approximate its rule, so both sides must agree on what a kernel, a wrapper or a flag is: keeping the
words here, and only here, makes a disagreement impossible rather than merely tested.

Standard library only: the gate runs before libcst is imported, and warm runs never import libcst.
"""

from __future__ import annotations

import re

# The buffer and its accessors ----------------------------------------------------------------------------
MAIN_GRAD = "main_grad"
GET_MAIN_GRAD = "get_main_grad"  # Megatron-FSDP parameters: returns (and creates) the buffer
FSDP_PARAM_MARKER = "__fsdp_param__"
# Attributes whose presence on a parameter means "Megatron-FSDP parameter: get_main_grad() exists".
FSDP_MARKERS = frozenset({GET_MAIN_GRAD, FSDP_PARAM_MARKER})
# Functions that set `param.main_grad` from `param.get_main_grad()` themselves (TE's ops helper).
BUILTIN_EXPOSURE_FUNCS = frozenset({"get_main_grad_from_param"})

# Flags on a parameter ------------------------------------------------------------------------------------
OVERWRITE_FLAG = "overwrite_main_grad"  # set by the wrapper: the next fused wgrad overwrites the buffer
GRAD_ADDED_FLAG = "grad_added_to_main_grad"  # set by a backward: the wgrad already landed in main_grad
# Functions that return a value read from the overwrite flag (TE's ops helper: `not overwrite_main_grad`).
OVERWRITE_READERS = frozenset({"get_accumulate_flag_in_param"})
# TE op-fuser ops' constructor flag, and the flag TE modules read.
ACCUMULATE_FLAG = "accumulate_into_main_grad"
FUSE_WGRAD_FLAG = "fuse_wgrad_accumulation"
# TE helpers that set `grad_added_to_main_grad` and build the dummy wgrad for the parameters they get.
FLAG_HELPERS = frozenset({"get_dummy_wgrads_for_params"})
# TE's dummy wgrad for one parameter (what a backward returns once the wgrad is in main_grad).
DUMMY_WGRAD_FUNCS = frozenset({"get_dummy_wgrad"})
# GEMMs whose `accumulate` keyword chooses between accumulating into and overwriting `out` (default: overwrite).
ACCUMULATE_GEMMS = frozenset({"general_gemm", "te_general_gemm", "general_grouped_gemm", "gemm", "fp8_gemm"})
# Names of functions that compute and write weight gradients (autograd backward and its helpers).
WGRAD_FUNCTION = re.compile(r"(^|_)backward(_|$)|wgrad", re.IGNORECASE)

# Writes into the buffer ----------------------------------------------------------------------------------
# Megatron's fused_weight_gradient_mlp_cuda kernels: (input, grad_output, main_grad) accumulate in place,
# with the precision of the buffer they expect.
KERNEL_PRECISION = {"wgrad_gemm_accum_fp32": "fp32", "wgrad_gemm_accum_fp16": "fp16"}
KERNELS = frozenset(KERNEL_PRECISION)
# GEMMs that write their product into `out=`.
GEMMS = frozenset(
    {"general_gemm", "te_general_gemm", "general_grouped_gemm", "gemm", "fp8_gemm", "matmul", "mm", "bmm"}
    | {"addmm", "baddbmm", "addbmm"}
)
# torch's matrix products (their `out` must have the inputs' dtype).
MATMULS = frozenset({"matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm"})
# In-place GEMM-accumulate methods called on the buffer itself: `W.main_grad.addmm_(a, b)`.
INPLACE_GEMMS = frozenset({"addmm_", "baddbmm_", "addbmm_"})
# Methods whose result is a view of (or the same storage as) their receiver.
VIEW_METHODS = frozenset(
    {"view", "view_as", "reshape", "detach", "t", "transpose", "flatten", "narrow", "chunk"}
)
# Methods that change a tensor's dtype (`float` is not one: it is the fp32 the buffer has).
CAST_METHODS = frozenset({"to", "type", "half", "bfloat16"})

# dtypes by name (`torch.<name>` or the string) ------------------------------------------------------------
LOW_DTYPES = frozenset(
    {"float16", "half", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}
)
FP32_DTYPES = frozenset({"float32", "float"})
DTYPES = LOW_DTYPES | FP32_DTYPES | {"float64", "double"}

# Names that denote a main_grad buffer, and names that denote a boolean about it --------------------------
BOOL_PREFIX = re.compile(r"^_*(accumulate|overwrite|use|is|has|fuse|grad_added|zero|skip|with|need|should)")
MAIN_GRAD_NAME = re.compile(r"main_grads?$")


def is_main_grad_name(name: str) -> bool:
    """`main_grad`, `wgrad_main_grad`, `main_grads`: a buffer, unless the name reads as a boolean."""
    return bool(MAIN_GRAD_NAME.search(name)) and not BOOL_PREFIX.match(name)


# Transformer Engine op fuser -----------------------------------------------------------------------------
TE_OPS = "transformer_engine.pytorch.ops"
TE_SEQUENTIAL = f"{TE_OPS}.Sequential"
CONTAINERS = (TE_SEQUENTIAL, f"{TE_OPS}.fuser.OperationFuser")
HOOKABLE_CONTAINER = TE_SEQUENTIAL  # OperationFuser is not a Module: it holds no hooks
CONTAINER_NAMES = frozenset(q.rsplit(".", 1)[-1] for q in CONTAINERS)
# Ops whose fused forward requires `main_grad` when built with accumulate_into_main_grad=True.
FORWARD_CHECKING_OPS = (f"{TE_OPS}.GroupedLinear",)
# What a hook replay reads: a module's registered pre-forward hooks.
PRE_HOOKS_ATTR = "_forward_pre_hooks"

# Whose code is it ----------------------------------------------------------------------------------------
# The data-parallel wrapper's own code (it owns the flags and knows its buffers), by path and by class.
WRAPPER_PATH = re.compile(
    r"(^|/)megatron/core/distributed/|(^|/)[^/]*fsdp[^/]*(/|$)|(^|/)[^/]*(data_parallel|ddp)[^/]*\.py$",
    re.IGNORECASE,
)
WRAPPER_CLASS = re.compile(r"fsdp|fullyshard|dataparallel|ddp|gradbuffer", re.IGNORECASE)
TEST_PATH = re.compile(r"(^|/)(tests?/|test_[^/]*\.py$|[^/]*_test\.py$|conftest\.py$)")
# A function named like an autograd backward or one of its helpers.
BACKWARD_NAME = re.compile(r"(^|_)backward(_|$)")


def posix(path: str) -> str:
    return path.replace("\\", "/")


def is_wrapper_path(path: str) -> bool:
    return WRAPPER_PATH.search(posix(path)) is not None


def is_test_path(path: str) -> bool:
    return TEST_PATH.search(posix(path)) is not None
