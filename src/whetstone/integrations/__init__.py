"""Other engines whetstone drives: vLLM as the rollout engine (docs/vllm.md).

`vllm` is whetstone's side (the policy, health, command line; no vLLM import); `vllm_serve` and
`vllm_worker` run inside vLLM's own virtual environment."""
