"""Project facts (`maingrad.analyzer.project`): what a scan's files establish together, and MG006 reading
them (a forced `overwrite_main_grad = True` is redundant where the scanned Megatron-FSDP only ever sets it
`True`). The facts must not depend on file order, `--jobs` or the cache."""

from __future__ import annotations

import importlib.util
import itertools
import shutil
from pathlib import Path
from typing import Any

import pytest

from maingrad.analyzer import runner
from maingrad.analyzer.project import FSDP_ONLY_SETS_OVERWRITE_TRUE, ProjectFacts, file_facts

FSDP = "megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py"
EXPERTS = "megatron/core/transformer/moe/experts.py"

# megatron-core 0.19.2's shape: the flag is set True on every unshard (but `no_shard`'s, which returns first).
FSDP_FORCES = """\
class MegatronFSDP:
    def all_gather_and_wait_parameters_ready(self, params):
        if self.data_parallel_sharding_strategy == "no_shard":
            return
        for param in params:
            param.overwrite_main_grad = True
"""
# Megatron-LM main's shape: derived from the strategy.
FSDP_DERIVES = FSDP_FORCES.replace(
    "= True", '= self.data_parallel_sharding_strategy in ["optim_grads", "optim_grads_params"]'
)
# TEGroupedMLP._ensure_main_grad: re-sets the flag only where it exists.
FORCED_WHERE_SET = """\
def _ensure_main_grad(linear_module):
    for param in linear_module.parameters(recurse=False):
        if hasattr(param, "overwrite_main_grad"):
            param.overwrite_main_grad = True
    return linear_module
"""
# Sets it everywhere: with `no_shard` (flag absent there) it would turn accumulation into overwriting.
FORCED_EVERYWHERE = """\
def _ensure_main_grad(linear_module):
    for param in linear_module.parameters(recurse=False):
        param.overwrite_main_grad = True
"""


def test_file_facts_need_the_wrapper_path() -> None:
    assert file_facts(FSDP, FSDP_FORCES) == ["wrapper-writes-overwrite-main-grad-true"]
    assert file_facts(FSDP, FSDP_DERIVES) == ["wrapper-writes-overwrite-main-grad-other"]
    assert file_facts("megatron/core/transformer/moe/router.py", FSDP_FORCES) == []  # not wrapper code
    assert file_facts("tests/unit_tests/megatron_fsdp/test_x.py", FSDP_FORCES) == []
    assert file_facts(EXPERTS, FORCED_WHERE_SET) == []
    assert file_facts(FSDP, "def f(:\n    overwrite_main_grad\n") == []  # unparsable: contributes nothing


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        ({FSDP: FSDP_FORCES}, True),
        ({FSDP: FSDP_DERIVES}, False),
        # A second wrapper module writing anything else breaks "only ever True".
        ({FSDP: FSDP_FORCES, "megatron/core/distributed/ddp.py": FSDP_DERIVES}, False),
        ({EXPERTS: FORCED_WHERE_SET}, False),
    ],
)
def test_project_fact_is_order_independent(texts: dict[str, str], expected: bool) -> None:
    per_file = [file_facts(path, text) for path, text in texts.items()]
    results = {
        FSDP_ONLY_SETS_OVERWRITE_TRUE in ProjectFacts.of(order) for order in itertools.permutations(per_file)
    }
    assert results == {expected}


def _scan(root: Path, jobs: int, cache: bool, hits: list[int] | None = None) -> list[tuple[str, int]]:
    from maingrad.analyzer.cache import ResultCache, cache_dir, settings_key
    from maingrad.analyzer.catalog import load_catalog
    from maingrad.analyzer.discovery import discover

    catalog = load_catalog(None)
    rules = tuple(meta for meta in catalog if meta.id == "MG006")
    settings = runner.ScanSettings(rules=rules, known_ids=tuple(meta.id for meta in catalog))
    files = discover([root], root)
    result_cache = ResultCache(cache_dir(root), settings_key(settings.cache_settings())) if cache else None
    result = runner.scan(files, settings, jobs=jobs, cache=result_cache)
    if hits is not None:
        hits.append(result.cache_hits)
    return [(f.path, f.line) for f in result.report.findings]


def _tree(root: Path, files: dict[str, str]) -> None:
    for relpath, text in files.items():
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


@pytest.mark.parametrize(
    ("files", "reported"),
    [
        ({FSDP: FSDP_FORCES, EXPERTS: FORCED_WHERE_SET}, False),  # megatron-core 0.19.2
        ({FSDP: FSDP_DERIVES, EXPERTS: FORCED_WHERE_SET}, True),  # Megatron-LM main
        ({EXPERTS: FORCED_WHERE_SET}, True),  # the wrapper is not in the scan: as for one file
        ({FSDP: FSDP_FORCES, EXPERTS: FORCED_EVERYWHERE}, True),  # not only where the wrapper set it
    ],
)
@pytest.mark.parametrize("jobs", [1, 2])
def test_mg006_reads_the_scanned_wrapper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str], reported: bool, jobs: int
) -> None:
    monkeypatch.setattr(runner, "POOL_MIN_CHARS", 0)  # jobs=2 really runs worker processes
    _tree(tmp_path, files)
    found = _scan(tmp_path, jobs, cache=False)
    assert bool(found) == reported
    assert all(path == EXPERTS for path, _ in found)


def test_cached_results_follow_the_project_facts(tmp_path: Path) -> None:
    """experts.py is unchanged (a cache hit by its bytes) but the wrapper changed: it is analyzed again."""
    _tree(tmp_path, {FSDP: FSDP_FORCES, EXPERTS: FORCED_WHERE_SET})
    (tmp_path / "bad.py").write_bytes(b"x = '\xff'\n")  # not UTF-8: a parse error, cached too
    hits: list[int] = []
    assert _scan(tmp_path, 1, cache=True, hits=hits) == []
    assert _scan(tmp_path, 1, cache=True, hits=hits) == []
    _tree(tmp_path, {FSDP: FSDP_DERIVES})
    assert _scan(tmp_path, 1, cache=True, hits=hits) == [(EXPERTS, 4)]
    assert _scan(tmp_path, 1, cache=True, hits=hits) == [(EXPERTS, 4)]  # now from the cache
    _tree(tmp_path, {FSDP: FSDP_FORCES})
    assert _scan(tmp_path, 1, cache=True, hits=hits) == []
    # Cold; all three cached; experts.py analyzed again (facts changed) and the wrapper (bytes changed);
    # all cached; the same again.
    assert hits == [0, 3, 1, 3, 1]


def _testbeds() -> Any:
    path = Path(__file__).resolve().parents[1] / "testbeds.py"
    spec = importlib.util.spec_from_file_location("maingrad_testbeds", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.network
@pytest.mark.slow
def test_megatron_core_0192_whole_wheel(tmp_path: Path) -> None:
    """The whole 0.19.2 wheel: its Megatron-FSDP forces the flag, so `_ensure_main_grad` is redundant (no
    MG006); with the wrapper's line as Megatron-LM main writes it, the same line is reported."""
    bed = _testbeds().testbed("megatron-core-0.19.2")
    assert _scan(bed, 2, cache=False) == []
    root = tmp_path / "bed"
    shutil.copytree(bed / "megatron", root / "megatron")
    wrapper = root / FSDP
    text = wrapper.read_text(encoding="utf-8")
    assert text.count("param.overwrite_main_grad = True") == 1
    wrapper.write_text(
        text.replace(
            "param.overwrite_main_grad = True",
            'param.overwrite_main_grad = self.data_parallel_sharding_strategy in ["optim_grads", "optim_grads_params"]',
        ),
        encoding="utf-8",
    )
    found = _scan(root, 2, cache=False)
    assert [path for path, _ in found] == [EXPERTS]
    line = (root / EXPERTS).read_text(encoding="utf-8").splitlines()[found[0][1] - 1]
    assert line.strip() == "param.overwrite_main_grad = True"
