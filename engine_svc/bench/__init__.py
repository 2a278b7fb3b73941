"""The benchmarks (`make bench`, `python -m engine_svc.bench MODE`): offline.py against
Hugging Face (and a vLLM build, vllm_worker.py), serve.py through the frontend; the machine
and its ceilings (machine.py, ceiling.py), the worker processes offline alternates and their
figures (worker.py, alternating.py), the structured-output step rate (structured.py), serving
workloads and their figures (workload.py, metrics.py)."""
