"""A stub executor that runs vLLM 0.34's engine code on a
CPU without a model: ``e2e/test_vllm034.py`` (docs/e2e.md, "vLLM 0.34's engine code").

Never part of the exporter and never installed anywhere: ``e2e/vllm034.py`` puts this folder
(nothing else in it) on ``PYTHONPATH`` of the 0.34 processes it starts, beside the 0.34 wheel's
``vllm`` package, and passes ``--distributed-executor-backend dp_e2e_stub.StubExecutor``.
vLLM 0.34 resolves a backend that is none of its names by qualified name
(``Executor.get_class``, ``vllm/v1/executor/abstract.py``: ``resolve_obj_by_qualname``, then
``issubclass(..., Executor)``), so every engine core builds this executor instead of its
``MultiprocExecutor``. What is real and what is not:

* **Real** (0.34's own code, unchanged): the CLI and its config (``VllmConfig``, the CPU
  platform's ``check_and_update_config``), the headless launcher, ``EngineCoreProc`` /
  ``DPEngineCoreProc``, the start-up handshake (HELLO, INIT, READY) and the registration
  (``EngineCoreReadyResponse``), the busy loop, the scheduler and its KV-cache manager, every
  utility call (``is_sleeping``, ``is_scheduler_paused``, ``get_weight_version``,
  ``checkpoint_state``, ``pause_scheduler``, ``sleep``, ``checkpoint_prepare``, ...), and, in
  relay mode, the front end.
* **Stubbed**: the worker. ``collective_rpc`` calls a ``StubWorker`` in this process: a fixed
  KV-cache spec (the tiny model's 2 layers), a fixed memory budget, no weights, and a "model"
  whose next token is ``w<n mod 500>`` for a sequence of ``n`` tokens (so completions flow and
  read back deterministically). ``sleep``, ``wake_up``, ``discard``, ``checkpoint_prepare``,
  ``checkpoint_restore`` answer as a worker that did it.
* **The platform**: vLLM's CPU platform with its Triton CPU check relaxed and, with
  ``DP_E2E_SLEEP_MODE=1``, sleep mode allowed (``dp_e2e_platform.py``, a platform plugin).
* **Not run**: the model runner, GPU memory and sleep-mode pools, the communicators a
  checkpoint releases (``Worker.checkpoint_prepare`` on GPUs): what a real worker does.

A test-only observation: ``EngineCoreProc._make_ready_response`` is wrapped to log the keys of
the registration the engine sends (one line, ``READY_LOG_PREFIX``), which the test reads from
the engine's log; the response itself is returned unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vllm.logger import init_logger  # type: ignore[import-not-found]
from vllm.v1.engine.core import EngineCoreProc  # type: ignore[import-not-found]
from vllm.v1.executor.abstract import Executor  # type: ignore[import-not-found]
from vllm.v1.kv_cache_interface import FullAttentionSpec  # type: ignore[import-not-found]
from vllm.v1.outputs import ModelRunnerOutput  # type: ignore[import-not-found]
from vllm.v1.worker.worker_base import CompilationTimes  # type: ignore[import-not-found]

logger = init_logger("vllm.dp_e2e_stub")

#: The tiny model's attention layers (``e2e/tiny_model.py``: 2 layers, 2 KV heads of 64).
LAYERS = 2
KV_HEADS = 2
HEAD_SIZE = 64
#: The KV-cache memory the stub worker reports (``determine_available_memory``): 64 MiB.
KV_CACHE_BYTES = 64 * 1024 * 1024
#: The tiny model's tokenizer: ``<unk> <s> </s>`` then ``w0 .. w499``.
FIRST_WORD_ID = 3
WORDS = 500
#: The engine's log line the test reads: this prefix, then the registration's keys as JSON.
READY_LOG_PREFIX = "dp-e2e-stub READY registration:"


def next_token(sequence_length: int) -> int:
    """The stub model's next token for a sequence of ``sequence_length`` tokens."""
    return FIRST_WORD_ID + sequence_length % WORDS


class StubWorker:
    """What ``collective_rpc`` reaches: answers as vLLM 0.34's worker would, holding no model."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.sleeping: set[str] = set()
        #: Request id → its sequence length (prompt and generated tokens).
        self.lengths: dict[str, int] = {}

    # -- start-up --------------------------------------------------------------------------

    def get_kv_cache_spec(self) -> dict[str, Any]:
        config = self.vllm_config
        return {
            f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
                block_size=config.cache_config.block_size,
                num_kv_heads=KV_HEADS,
                head_size=HEAD_SIZE,
                dtype=config.model_config.dtype,
            )
            for i in range(LAYERS)
        }

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]

    def set_kv_cache_layout(self, layout: str, interleave: int) -> None:
        logger.info("stub worker: KV cache layout %s", layout)

    def determine_available_memory(self) -> int:
        return KV_CACHE_BYTES

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        """One config per worker (``WorkerWrapperBase`` picks its rank's): here, the one."""
        logger.info("stub worker: %d KV cache blocks", kv_cache_configs[0].num_blocks)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def update_max_model_len(self, max_model_len: int) -> None:
        self.vllm_config.model_config.max_model_len = max_model_len

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_kv_connector_handshake_metadata(self) -> None:
        return None

    def supports_draft_weight_updates(self) -> bool:
        return False

    def extensible_kv_cache_unsupported_reason(self) -> str:
        return "the stub worker holds no KV cache"

    def disable_extensible_kv_cache(self) -> None:
        return None

    # -- the "model" -------------------------------------------------------------------------

    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput:
        """One token for every request whose scheduled tokens reach its sequence's end (a
        prefill chunk short of it samples nothing: vLLM's runner discards such a token). The
        output is returned at once, so the engine core never calls ``sample_tokens``."""
        for req_id in scheduler_output.finished_req_ids:
            self.lengths.pop(req_id, None)
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            self.lengths[new.req_id] = len(new.prefill_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, done in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            computed[req_id] = done
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            req_ids.append(req_id)
            length = self.lengths.get(req_id, 0)
            if computed.get(req_id, 0) + count >= length:
                sampled.append([next_token(length)])
                self.lengths[req_id] = length + 1
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def sample_tokens(self, grammar_output: Any) -> None:
        return None

    def take_draft_token_ids(self) -> None:
        return None

    def execute_dummy_batch(self) -> None:
        return None

    # -- control -----------------------------------------------------------------------------

    def synchronize_device(self) -> None:
        return None

    def sleep(self, level: int = 1) -> None:
        self.sleeping |= {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleeping -= set(tags or ("weights", "kv_cache"))

    def discard(self, tags: tuple[str, ...]) -> None:
        self.sleeping |= set(tags)

    def checkpoint_prepare(self) -> None:
        logger.info("stub worker: checkpoint_prepare (no distributed state to release)")

    def checkpoint_restore(self) -> None:
        logger.info("stub worker: checkpoint_restore")

    def has_incomplete_weight_update(self) -> bool:
        return False

    def compute_weight_checksums(self) -> dict[str, str]:
        return {}

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


class StubExecutor(Executor):  # type: ignore[misc]
    """vLLM 0.34's ``Executor`` over one ``StubWorker`` in the engine core's own process."""

    def _init_executor(self) -> None:
        self.worker = StubWorker(self.vllm_config)
        logger.info("dp-e2e-stub: StubExecutor in place of the worker processes (no model)")

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
    ) -> Any:
        try:
            if isinstance(method, str):
                result = getattr(self.worker, method)(*args, **(kwargs or {}))
            else:
                result = method(self.worker, *args, **(kwargs or {}))
        except Exception as exc:
            if not non_block:
                raise
            failed: Future[Any] = Future()
            failed.set_exception(exc)
            return failed
        if not non_block:
            return [result]
        done: Future[Any] = Future()
        done.set_result([result])
        return done

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        return self._single("execute_model", scheduler_output, non_block)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        return self._single("sample_tokens", grammar_output, non_block)

    def _single(self, method: str, arg: Any, non_block: bool) -> Any:
        result = getattr(self.worker, method)(arg)
        if not non_block:
            return result
        done: Future[Any] = Future()
        done.set_result(result)
        return done

    def check_health(self) -> None:
        return None


def _log_ready_keys() -> None:
    original = EngineCoreProc._make_ready_response

    def logged(self: Any) -> Any:
        response = original(self)
        fields = [f for f in type(response).__dataclass_fields__ if not f.startswith("_")]
        config = getattr(response, "vllm_config", None)
        logger.info(
            "%s %s",
            READY_LOG_PREFIX,
            json.dumps(
                {
                    "keys": fields,
                    "vllm_config_keys": len(config) if isinstance(config, dict) else None,
                    "data_parallel_rank": response.data_parallel_rank,
                    "num_gpu_blocks": response.num_gpu_blocks,
                    "block_size": response.block_size,
                    "kv_cache_size_tokens": response.kv_cache_size_tokens,
                    "enable_sleep_mode": response.enable_sleep_mode,
                }
            ),
        )
        return response

    EngineCoreProc._make_ready_response = logged


_log_ready_keys()
