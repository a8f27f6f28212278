"""The engine on the GPU: Triton attention, CUDA-graph decode and prefill, isolation and memory.

GPU tests (-m gpu) use the SmolLM2-135M architecture with seeded random weights in bf16 and compare
with the same weights on the CPU in fp32. bf16 moves logits by about 1e-2 of their spread, and with
random weights the top two logits are often closer than that, so greedy tokens are only comparable
where the CPU's top-1 margin is safely larger than bf16 noise. The references are therefore
prompts whose every generated token has a CPU margin of at least SAFE_MARGIN (about six standard
deviations of the bf16-vs-fp32 logit difference measured on the CPU); for those, every GPU
configuration (solo, batched, interleaved, graph, eager, forked) must produce the CPU's tokens.

CPU tests here need no CUDA: bucket choice, workspace sizing, and the Triton kernel's math run by
Triton's interpreter (fp32/fp16: the interpreter's bf16 dot is not exact).

By concept: test_attention (the kernels), test_engine (tokens against the CPU, isolation), test_graphs
(buckets and graph executors), test_memory (weights, slots, churn); references.py and device.py hold
what they share, conftest.py the engines, each loaded once for the package.
"""
