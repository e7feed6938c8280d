"""The precisions the weight benches compare: name -> (weights, compute dtype), all from the default model's file.
int4/int8 compute in float32 by default (bf16 only inside the kernels); the -bf16 rows compute in bfloat16."""

PRECISIONS = {
    "full-fp32": ("full", "float32"),
    "full-bf16": ("full", "bfloat16"),
    "int8": ("int8", "float32"),
    "int8-bf16": ("int8", "bfloat16"),
    "int4-bf16": ("int4", "bfloat16"),
    "int4": ("int4", "float32"),
    "w4a8": ("w4a8", "float32"),
    "w4a8-bf16": ("w4a8", "bfloat16"),
}
