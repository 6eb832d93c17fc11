"""Layout resolvers: the contract on every engine layout, plus each resolver's own rules."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.kinds import LAYOUT_RESOLVER
from kvtier.layout.base import LayoutError, LayoutResolver
from kvtier.layout.resolvers import AutoResolver, PerLayerResolver
from kvtier.plugins import build_plugin_manager, collect
from kvtier.testing.contracts_layout import (
    MLA_DIM,
    LayoutCase,
    LayoutResolverContract,
    all_cases,
    block_first_case,
    cross_layer_case,
    flash_attn_case,
    hybrid_overlay_case,
    mamba_case,
    shared_layers_case,
    vllm_cpu_packed_case,
)

BUILDERS = all_cases()


def _ids(builders: list[Callable[[], LayoutCase]]) -> list[str]:
    return [builder().name for builder in builders]


def _cases_for(kind: str) -> list[Callable[[], LayoutCase]]:
    return [builder for builder in BUILDERS if kind in builder().resolvers]


def _resolver(kind: str) -> LayoutResolver:
    return AutoResolver() if kind == "auto" else PerLayerResolver(kind)


class TestFlashAttnContract(LayoutResolverContract):
    @pytest.fixture
    def resolver(self) -> LayoutResolver:
        return _resolver("flash_attn")

    @pytest.fixture(params=_cases_for("flash_attn"), ids=_ids(_cases_for("flash_attn")))
    def case(self, request: pytest.FixtureRequest) -> LayoutCase:
        return request.param()  # type: ignore[no-any-return]


class TestBlockFirstContract(LayoutResolverContract):
    @pytest.fixture
    def resolver(self) -> LayoutResolver:
        return _resolver("block_first")

    @pytest.fixture(params=_cases_for("block_first"), ids=_ids(_cases_for("block_first")))
    def case(self, request: pytest.FixtureRequest) -> LayoutCase:
        return request.param()  # type: ignore[no-any-return]


class TestMambaContract(LayoutResolverContract):
    @pytest.fixture
    def resolver(self) -> LayoutResolver:
        return _resolver("mamba")

    @pytest.fixture(params=_cases_for("mamba"), ids=_ids(_cases_for("mamba")))
    def case(self, request: pytest.FixtureRequest) -> LayoutCase:
        return request.param()  # type: ignore[no-any-return]


class TestAutoContract(LayoutResolverContract):
    @pytest.fixture
    def resolver(self) -> LayoutResolver:
        return _resolver("auto")

    @pytest.fixture(params=BUILDERS, ids=_ids(BUILDERS))
    def case(self, request: pytest.FixtureRequest) -> LayoutCase:
        return request.param()  # type: ignore[no-any-return]


def test_every_case_is_resolved_by_auto() -> None:
    assert all("auto" in builder().resolvers for builder in BUILDERS)


def test_builtins_are_registered_with_their_config_models() -> None:
    registry = collect(build_plugin_manager(env={"KVTIER_LOAD_PLUGINS": ""}))
    for name in ("auto", "flash_attn", "block_first", "mamba"):
        registration = registry.get(LAYOUT_RESOLVER, name)
        resolver = registry.build(LAYOUT_RESOLVER, registration.config_model())
        assert isinstance(resolver, LayoutResolver)
        layout = resolver.resolve(
            mamba_case().kv_caches
            if name == "mamba"
            else flash_attn_case().kv_caches
            if name in ("flash_attn", "auto")
            else block_first_case("cpu").kv_caches
        )
        assert layout.kind == ("flash_attn" if name == "auto" else name)


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_flash_attn_splits_k_and_v_per_layer(order: str) -> None:
    case = flash_attn_case(num_layers=3, order=order, dtype=torch.bfloat16)
    layout = PerLayerResolver("flash_attn").resolve(case.kv_caches)
    assert layout.kind == "flash_attn"
    assert len(layout.regions) == 6
    assert {region.bytes_per_block for region in layout.regions} == {16 * 2 * 8 * 2}
    assert layout.regions[0].name == "model.layers.0.attn[0]"
    assert layout.regions[1].name == "model.layers.0.attn[1]"


def test_flash_attn_with_kv_packed_inside_each_block_is_one_region_per_layer() -> None:
    physical = torch.zeros((12, 2, 16, 2, 8), dtype=torch.float16)
    layout = PerLayerResolver("flash_attn").resolve({"layer": physical.transpose(0, 1)})
    assert len(layout.regions) == 1
    assert layout.regions[0].bytes_per_block == 2 * 16 * 2 * 8 * 2


def test_cross_layer_blocks_become_one_region() -> None:
    layout = AutoResolver().resolve(cross_layer_case(num_layers=4).kv_caches)
    assert layout.kind == "block_first"
    assert len(layout.regions) == 1
    assert layout.regions[0].name == "model.layers.0.attn..model.layers.3.attn"
    assert layout.record_bytes == 4 * 2 * 16 * 2 * 8 * 2


@pytest.mark.parametrize("block_outermost, regions", [(False, 4), (True, 1)])
def test_vllm_cpu_packing(block_outermost: bool, regions: int) -> None:
    case = vllm_cpu_packed_case(block_outermost, num_layers=4)
    layout = AutoResolver().resolve(case.kv_caches)
    assert len(layout.regions) == regions
    assert layout.record_bytes == 4 * 2 * 16 * 2 * 8 * 2


def test_mamba_states_of_a_layer_become_one_region_strided_by_the_page() -> None:
    case = mamba_case(num_layers=3, page_padded_bytes=1024)
    layout = PerLayerResolver("mamba").resolve(case.kv_caches)
    conv_bytes, ssm_bytes = 3 * 40 * 2, 2 * 8 * 4 * 4
    assert [region.bytes_per_block for region in layout.regions] == [conv_bytes + ssm_bytes] * 3
    assert {region.block_stride_bytes for region in layout.regions} == {3 * 1024}
    assert layout.kind == "mamba"


def test_shared_storage_is_counted_once() -> None:
    layout = AutoResolver().resolve(shared_layers_case().kv_caches)
    assert len(layout.regions) == 4  # two distinct tensors, K and V each


def test_hybrid_overlay_counts_the_shared_pages_once() -> None:
    layout = AutoResolver().resolve(hybrid_overlay_case().kv_caches)
    assert layout.kind == "block_first+mamba"
    assert len(layout.regions) == 1
    assert layout.record_bytes == 2 * 16 * 2 * 8 * 2


def test_auto_prefers_flash_attn_when_a_tensor_reads_both_ways() -> None:
    caches = {"a": torch.zeros((2, 2, 4, 2, 8), dtype=torch.float16)}
    assert AutoResolver().resolve(caches).kind == "flash_attn"


def test_auto_uses_other_layers_to_settle_the_block_count() -> None:
    caches = {
        "attn": torch.zeros((2, 6, 4, 2, 8), dtype=torch.float16),  # flash_attn, 6 blocks
        "mla": torch.zeros((6, 4, 16), dtype=torch.float16),
    }
    layout = AutoResolver().resolve(caches)
    assert layout.num_blocks == 6
    assert layout.kind == "block_first+flash_attn"


def test_auto_names_the_tensor_it_cannot_resolve() -> None:
    caches = {
        "layers.0": torch.zeros((8, 4, 16)),
        "layers.1": torch.zeros((8, 4, 16)),
        "layers.2": torch.zeros((5, 4, 16)),
    }
    with pytest.raises(LayoutError, match=r"layers\.2 \(shape \(5, 4, 16\), stride"):
        AutoResolver().resolve(caches)


@pytest.mark.parametrize(
    "value, message",
    [
        (torch.zeros(16), "cannot tell which dimension"),
        ("not a tensor", "is a str"),
        ([], "non-empty list"),
        (torch.zeros((4, 1)).expand(4, 8), "broadcast"),
        (torch.zeros((0, 4)), "empty"),
    ],
)
def test_auto_rejects_unusable_values_naming_the_layer(value: object, message: str) -> None:
    with pytest.raises(LayoutError, match=message) as excinfo:
        AutoResolver().resolve({"layers.7.attn": value})  # type: ignore[dict-item]
    assert "layers.7.attn" in str(excinfo.value)


def test_flash_attn_rejects_a_block_first_tensor() -> None:
    with pytest.raises(LayoutError, match=r"flash_attn: layer x is not a \(2, num_blocks"):
        PerLayerResolver("flash_attn").resolve({"x": torch.zeros((5, 4, 16))})


def test_overlapping_blocks_are_rejected() -> None:
    base = torch.zeros(64, dtype=torch.uint8)
    overlapping = base.as_strided((8, 16), (4, 1))
    with pytest.raises(LayoutError, match="overlap"):
        PerLayerResolver("block_first").resolve({"x": overlapping})


def test_same_bytes_with_different_block_strides_are_rejected() -> None:
    raw = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="different block sizes"):
        PerLayerResolver("block_first").resolve({"a": raw.view(8, 512), "b": raw.view(16, 256)[:8]})


def test_block_count_mismatch_names_both_tensors() -> None:
    with pytest.raises(LayoutError, match="has 6 blocks but"):
        PerLayerResolver("block_first").resolve(
            {"a": torch.zeros((8, 16)), "b": torch.zeros((6, 16))}
        )


def test_unknown_per_layer_kind() -> None:
    with pytest.raises(ValueError, match="unknown per-layer layout"):
        PerLayerResolver("paged")


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]),
)
def test_any_stride_order_resolves_to_exact_block_rows(
    sizes: list[int], data: st.DataObject, dtype: torch.dtype
) -> None:
    """A tensor stored in any dimension order, any dimension taken as blocks."""
    order = data.draw(st.permutations(range(len(sizes))))
    block_dim = data.draw(st.integers(0, len(sizes) - 1))
    physical = torch.zeros([sizes[dim] for dim in order], dtype=dtype)
    tensor = physical.permute([order.index(dim) for dim in range(len(sizes))])
    assert list(tensor.shape) == sizes
    moved = tensor.movedim(block_dim, 0)
    case = LayoutCase(
        "random", {"layer": moved}, sizes[block_dim], ((moved, 0),), frozenset({"block_first"})
    )
    layout = PerLayerResolver("block_first").resolve(case.kv_caches)
    contract = LayoutResolverContract()
    contract.test_regions_are_byte_rows(layout, case)
    contract.test_regions_cover_engine_bytes_once(layout, case)
    contract.test_row_i_holds_block_i(layout, case)


@pytest.mark.parametrize(
    ("make", "shape", "scale_axes"),
    [
        # (block_tokens, heads, head_dim), K and V in regions of their own
        (lambda: flash_attn_case(order="NHD"), (16, 2, 8), (1,)),
        (lambda: flash_attn_case(order="HND"), (2, 16, 8), (0,)),
        # (2, block_tokens, heads, head_dim)
        (lambda: block_first_case("flashinfer"), (2, 16, 2, 8), (0, 2)),
        (lambda: block_first_case("mla"), (16, MLA_DIM), ()),
        # (heads, block_tokens, K or V, head_dim): the halves of each row
        (lambda: block_first_case("cpu"), (2, 16, 2, 8), (0, 2)),
        # a block's layers side by side stack along a new first axis
        (lambda: vllm_cpu_packed_case(block_outermost=True), (4, 2, 16, 2, 8), (0, 1, 3)),
    ],
    ids=["nhd", "hnd", "flashinfer", "mla", "cpu", "cpu_block_outer"],
)
def test_regions_say_what_their_blocks_hold_for_codecs(
    make: Callable[[], LayoutCase], shape: tuple[int, ...], scale_axes: tuple[int, ...]
) -> None:
    layout = AutoResolver().resolve(make().kv_caches)
    formats = {region.format for region in layout.record_regions}
    assert len(formats) == 1
    (known,) = formats
    assert known is not None and (known.shape, known.scale_axes) == (shape, scale_axes)
    assert known.dtype in ("float16", "bfloat16")
    assert [region.offset_bytes for region in layout.record_regions] == list(layout.record_offsets)


def test_mamba_states_have_no_format_a_codec_could_read() -> None:
    layout = AutoResolver().resolve(mamba_case().kv_caches)
    assert all(region.format is None for region in layout.record_regions)
