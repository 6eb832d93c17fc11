"""vLLM's real scheduler and both halves of kvtier's connector, stepped without a model.

:class:`VllmSteps` builds what vLLM's engine core builds — a ``VllmConfig``
with kvtier as its KV connector, vLLM's ``Scheduler`` (which creates the
scheduler-side connector itself), a worker-side ``KVTierConnector`` over KV
tensors laid out by vLLM's own allocator code in a chosen ``KVCacheLayout`` —
and runs engine steps by hand, as vLLM's connector unit tests do:

1. ``Scheduler.schedule()``;
2. the worker connector's calls in the model runner's order
   (``handle_preemptions``, ``bind_connector_metadata``, ``start_load_kv``
   before the "forward" on steps with same-step loads, after it on the others,
   ``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``,
   ``build_connector_worker_meta``);
3. a ``ModelRunnerOutput`` built by hand (one sampled token per request that
   finished its prefill) and ``Scheduler.update_from_output()``.

The "forward" writes every block a request completes with values derived from
the block's hash and layer (:func:`tests.support.engine.block_values`), so a
block loaded from the tier is checked byte for byte against what it must hold
(:attr:`VllmSteps.mismatches`). It runs on CPU tensors with any vLLM release
kvtier supports; only ``config.json`` of a model is needed (no weights).

The same engine runs with another connector (``connector``), or none, and
without writing or checking blocks (:attr:`StepsSpec.write_blocks`), so a
benchmark times vLLM's own scheduler beside kvtier's halves
(:attr:`VllmSteps.step_s`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.integrations.checkpoints import TinyLlamaSpec
from tests.support.engine import block_values

LAYOUT_STRIDES = {
    # (layer stride, block stride) of a dense buffer, in pages (heads: in head pages)
    "LBHNC": ("blocks", "page"),
    "LBNHC": ("blocks", "page"),
    "LHBNC": ("blocks", "head"),
    "BLHNC": ("page", "layers"),
    "BLNHC": ("page", "layers"),
    "BHLNC": ("head", "layers"),
}
"""How vLLM packs one dense buffer in each ``KVCacheLayout``."""


KVTIER_CONNECTOR = ("KVTierConnector", "kvtier.integrations.vllm")
"""kvtier's connector: vLLM's ``kv_connector`` and ``kv_connector_module_path``."""


def kv_cache_tensor_strides(
    layout_name: str, page_bytes: int, num_layers: int, num_blocks: int, heads: int
) -> tuple[int, int]:
    """``(layer_stride, block_stride)`` in bytes of a dense buffer packed in ``layout_name``."""
    sizes = {
        "page": page_bytes,
        "head": page_bytes // heads,
        "blocks": num_blocks * page_bytes,
        "layers": num_layers * page_bytes,
    }
    layer, block = LAYOUT_STRIDES[layout_name]
    return sizes[layer], sizes[block]


def write_model_config(directory: str | Path, spec: TinyLlamaSpec | None = None) -> Path:
    """Write only ``config.json`` of a small Llama: enough for vLLM's ``ModelConfig``."""
    spec = spec or TinyLlamaSpec()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@dataclass(frozen=True)
class StepsSpec:
    """Shape of the engine :class:`VllmSteps` drives."""

    num_blocks: int = 64
    """Device blocks of vLLM's KV cache."""
    block_tokens: int = 16
    """Tokens per block."""
    layout: str = "LBNHC"
    """vLLM's ``KVCacheLayout`` name of the KV tensors."""
    kernel_block_tokens: int | None = None
    """Tokens per attention-kernel block, when kernels take smaller blocks than the scheduler
    (vLLM then views each layer in kernel blocks); ``None``: the scheduler's blocks."""
    max_num_batched_tokens: int = 256
    """Tokens one step may schedule (long prompts prefill in chunks)."""
    max_num_seqs: int = 8
    """Requests one step may schedule."""
    max_model_len: int = 1024
    """Longest request, in tokens."""
    kv_events: bool = False
    """Publish KV-cache events (to a publisher :attr:`VllmSteps.events` records)."""
    model: TinyLlamaSpec = field(default_factory=TinyLlamaSpec)
    """The model whose KV-cache shape (layers, KV heads, head size) the tensors take."""
    clock: Callable[[], float] = time.perf_counter
    """The seconds :attr:`VllmSteps.step_s` reads: wall time, or e.g. ``time.thread_time``
    (the stepping thread's CPU time, which other processes on a busy machine do not inflate)."""
    write_blocks: bool = True
    """The "forward" writes the blocks requests complete and checks loaded blocks; ``False``:
    it touches no tensor (the KV tensors are then left uninitialised)."""


class VllmSteps:
    """A model-free vLLM engine with kvtier: real scheduler, real connector, CPU tensors."""

    def __init__(
        self,
        model_dir: str | Path,
        kvtier: Mapping[str, Any],
        spec: StepsSpec,
        *,
        connector: tuple[str, str] | None = KVTIER_CONNECTOR,
    ) -> None:
        """Build the configs, the scheduler (and its connector), the KV tensors and the worker.

        Args:
            model_dir: A directory with a ``config.json`` matching ``spec.model``
                (:func:`write_model_config`).
            kvtier: kvtier's config (``kv_connector_extra_config``).
            spec: The engine's shape.
            connector: The KV connector's class name and module path (default: kvtier's);
                ``None``: vLLM runs without a connector and there is no worker half.
        """
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            create_kv_cache_views,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager

        from kvtier.integrations.vllm.worker import manager_block_views

        self.spec = spec
        self._sampling = SamplingParams
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=str(model_dir),
                skip_tokenizer_init=True,
                dtype="bfloat16",
                max_model_len=spec.max_model_len,
            ),
            cache_config=CacheConfig(block_size=spec.block_tokens, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=spec.max_num_batched_tokens,
                max_num_seqs=spec.max_num_seqs,
                max_model_len=spec.max_model_len,
                is_encoder_decoder=False,
            ),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector=connector[0],
                kv_connector_module_path=connector[1],
                kv_role="kv_both",
                kv_connector_extra_config=dict(kvtier),
            )
            if connector is not None
            else None,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            if spec.kv_events
            else None,
        )
        model = spec.model
        attention = FullAttentionSpec(
            block_size=spec.block_tokens,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_dim,
            dtype=torch.bfloat16,
        )
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(model.num_layers)]
        page = attention.page_size_bytes
        layer_stride, block_stride = kv_cache_tensor_strides(
            spec.layout, page, model.num_layers, spec.num_blocks, model.num_kv_heads
        )
        tensor = KVCacheTensor(
            size=model.num_layers * spec.num_blocks * page,
            layers=self.layer_names,
            layer_stride=layer_stride,
            block_stride=block_stride,
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=spec.num_blocks,
            kv_cache_tensors=[tensor],
            kv_cache_groups=[KVCacheGroupSpec(self.layer_names, attention)],
        )
        self.vllm_config.cache_config.num_gpu_blocks = spec.num_blocks
        allocate = torch.zeros if spec.write_blocks else torch.empty
        raw = allocate(tensor.size, dtype=torch.int8)
        views = create_kv_cache_views(
            raw,
            attention,
            spec.num_blocks,
            KVCacheLayout[spec.layout],
            tensor,
            kernel_block_size=spec.kernel_block_tokens,
        )
        self.kv_caches: dict[str, torch.Tensor] = dict(zip(self.layer_names, views, strict=True))
        # The "model" writes and checks whole scheduler blocks, however the kernels see them.
        self.block_views = manager_block_views(self.kv_caches, spec.num_blocks)

        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(spec.block_tokens, sha256)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=spec.block_tokens,
            log_stats=True,
        )
        self.worker: Any = None
        if connector is not None:
            self.worker = KVConnectorFactory.create_connector(
                self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
            )
            self.worker.register_kv_caches(self.kv_caches)

        self.events: list[Any] = []
        if spec.kv_events:
            publisher = self.scheduler.kv_event_publisher
            publish = publisher.publish
            publisher.publish = lambda batch: self.events.append(batch) or publish(batch)
        self.outputs: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.connector_stats: list[dict[str, Any]] = []
        self.preemptions = 0
        self.loaded_blocks = 0
        self.failed_blocks = 0
        self.mismatches: list[str] = []
        self._next_id = 0
        self._loads: dict[str, list[int]] = {}
        self.step_s: dict[str, float] = {}
        """The last step's seconds in ``schedule`` (vLLM's ``schedule()``), ``worker`` (the
        worker connector's calls) and ``update`` (vLLM's ``update_from_output()``)."""

    @property
    def connector(self) -> Any:
        """The scheduler-side ``KVTierConnector`` vLLM's scheduler created."""
        return self.scheduler.connector

    def add(
        self,
        prompt: Sequence[int],
        max_tokens: int = 1,
        kv_transfer_params: Mapping[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request, with ``kv_transfer_params`` and a tenant's ``cache_salt`` if
        given; return its id."""
        from vllm.v1.request import Request

        request_id = f"req-{self._next_id}"
        self._next_id += 1
        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=self._sampling(
                max_tokens=max_tokens, ignore_eos=True, extra_args=extra
            ),
            pooling_params=None,
            block_hasher=self._hasher,
            cache_salt=cache_salt,
        )
        self.scheduler.add_request(request)
        self.outputs[request_id] = []
        return request_id

    def step(self) -> Any:
        """One engine step; returns the ``SchedulerOutput``."""
        from vllm.v1.outputs import ModelRunnerOutput

        clock = self.spec.clock
        started = clock()
        output = self.scheduler.schedule()
        scheduled = clock()
        self.preemptions += len(output.preempted_req_ids or ())
        if self.worker is None:
            kv_output, worker_s = None, 0.0
            sampled = self._forward(output)
        else:
            kv_output, sampled, worker_s = self._worker_step(output)
        req_ids = list(sampled)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(req_ids)},
            sampled_token_ids=[sampled[request_id] for request_id in req_ids],
            kv_connector_output=kv_output,
        )
        updating = clock()
        client_outputs = self.scheduler.update_from_output(output, runner_output)
        self.step_s = {
            "schedule": scheduled - started,
            "worker": worker_s,
            "update": clock() - updating,
        }
        for client_output in client_outputs.values():
            for request_output in client_output.outputs:
                self.outputs[request_output.request_id].extend(request_output.new_token_ids)
                if request_output.finish_reason is not None:
                    self.finished.add(request_output.request_id)
            stats = client_output.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.connector_stats.append(dict(stats.kv_connector_stats))
        return output

    def _worker_step(self, output: Any) -> tuple[Any, dict[str, list[int]], float]:
        """The worker connector's calls around the "forward": its ``KVConnectorOutput``, the
        sampled tokens and the seconds the calls took."""
        from vllm.v1.outputs import KVConnectorOutput

        from kvtier.integrations.vllm.connector import KVTierMetadata

        worker = self.worker
        metadata = output.kv_connector_metadata
        checking = self.spec.write_blocks and isinstance(metadata, KVTierMetadata)
        clock = self.spec.clock
        started = clock()
        worker.handle_preemptions(metadata)
        worker.bind_connector_metadata(metadata)
        if output.has_sync_kv_loads:  # as vLLM's model runner: before the forward
            worker.start_load_kv(None)
        worker_s = clock() - started
        loaded_now: dict[int, list[torch.Tensor]] = {}
        if checking:
            for transfer in metadata.plan.loads:
                self._loads.setdefault(transfer.request_id, []).extend(transfer.device_blocks)
            # what same-step loads wrote, before the forward writes the last token's block again
            loaded_now = {
                block: [self.block_views[name][block].clone() for name in self.layer_names]
                for request_id in metadata.plan.same_step
                for block in self._loads.get(request_id, ())
            }
        sampled = self._forward(output)
        started = clock()
        if not output.has_sync_kv_loads:  # as vLLM's model runner: after the forward
            worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(output.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        worker_s += clock() - started
        self.failed_blocks += len(invalid)
        if checking:
            for request_id in metadata.plan.same_step:
                self._check_loaded(request_id, invalid, loaded_now)
            for request_id in results.finished_recving or ():
                if request_id in (results.failed_recving or ()):
                    self._loads.pop(request_id, None)
                else:
                    self._check_loaded(request_id, invalid)
        started = clock()
        stats = worker.get_kv_connector_stats()
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        worker_s += clock() - started
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=set(results.failed_recving or ()),
            invalid_block_ids=invalid,
            kv_connector_stats=stats,
            kv_connector_worker_meta=worker_meta,
        )
        return kv_output, sampled, worker_s

    def run(self, max_steps: int = 500) -> None:
        """Step until the scheduler has no request and no copy is in flight.

        Raises:
            AssertionError: If that takes more than ``max_steps`` steps.
        """
        for _ in range(max_steps):
            pending = self.connector is not None and self.connector.has_pending_push_work()
            if not self.scheduler.requests and not pending:
                return
            self.step()
            time.sleep(0)
        raise AssertionError(f"the engine still had work after {max_steps} steps")

    def generate(self, prompts: Iterable[Sequence[int]], max_tokens: int = 1) -> list[list[int]]:
        """Run ``prompts`` to completion; return their sampled tokens."""
        ids = [self.add(prompt, max_tokens) for prompt in prompts]
        self.run()
        return [self.outputs[request_id] for request_id in ids]

    def counter(self, name: str) -> float:
        """The sum of a kvtier counter over every step's connector stats."""
        return sum(stats.get(name, 0) for stats in self.connector_stats)

    def observations(self, name: str) -> list[float]:
        """Every observation of a kvtier histogram over every step's connector stats, in order."""
        return [value for stats in self.connector_stats for value in stats.get(name, [])]

    def close(self) -> None:
        """Shut the worker connector down (bounded wait for copies)."""
        if self.worker is not None:
            self.worker.shutdown()

    def _forward(self, output: Any) -> dict[str, list[int]]:
        """Write the blocks each scheduled request completes; sample for finished prefills."""
        sampled: dict[str, list[int]] = {}
        size = self.spec.block_tokens
        for request_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            end = request.num_computed_tokens
            if self.spec.write_blocks:
                start = end - count
                manager = self.scheduler.kv_cache_manager
                (block_ids,) = manager.get_blocks(request_id).get_block_ids()
                for position in range(start // size, min(end // size, len(request.block_hashes))):
                    self._write(block_ids[position], request.block_hashes[position])
            done = end >= request.num_tokens
            sampled[request_id] = [_next_token(request.all_token_ids)] if done else []
        return sampled

    def _write(self, block: int, block_hash: bytes) -> None:
        for index, name in enumerate(self.layer_names):
            target = self.block_views[name][block]
            target.copy_(block_values(block_hash, index, tuple(target.shape), target.dtype))

    def _check_loaded(
        self,
        request_id: str,
        failed: set[int],
        copies: Mapping[int, list[torch.Tensor]] | None = None,
    ) -> None:
        """Compare the blocks loaded for a request (or ``copies`` of them, per layer, taken
        right after the load) with what they must hold."""
        request = self.scheduler.requests.get(request_id)
        loaded = self._loads.pop(request_id, [])
        if request is None:
            return
        (block_ids,) = self.scheduler.kv_cache_manager.get_blocks(request_id).get_block_ids()
        for block in loaded:
            if block in failed:
                continue
            block_hash = request.block_hashes[block_ids.index(block)]
            for index, name in enumerate(self.layer_names):
                actual = (
                    copies[block][index] if copies else self.block_views[name][block]
                ).contiguous()
                expected = block_values(block_hash, index, tuple(actual.shape), actual.dtype)
                if not torch.equal(actual.view(torch.uint8), expected.view(torch.uint8)):
                    self.mismatches.append(f"{request_id} block {block} layer {name}")
            self.loaded_blocks += 1


def _next_token(tokens: Sequence[int]) -> int:
    """A deterministic "model": the next token depends on the whole sequence."""
    return (sum(tokens) * 31 + len(tokens)) % 1000
