"""preflight through torch's own wrappers (FSDP2, DDP; gloo, world size 1), the CLI, and the service's gate."""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from emulators import DenseBlock, MegatronFSDP, dense_batches, mse_loss, mse_microbatch

from maingrad.cli.main import main as cli_main
from maingrad.hooks.preflight.run import preflight
from maingrad.hooks.preflight.wrappers import choose


@pytest.fixture
def gloo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _double(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    """A micro-batch that back-propagates twice its loss (a loss-scaling mismatch)."""
    loss = mse_loss(model, batch)
    (2 * loss).backward()
    return loss.detach()


def test_fsdp2(gloo: None) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    block = DenseBlock("plain", dropout=0.2)
    fully_shard(block.mid)
    fully_shard(block)
    assert type(choose(block)).__name__ == "Fsdp2Adapter"
    before = {n: p.to_local().clone() for n, p in block.named_parameters()}
    result = preflight(block, mse_microbatch, dense_batches(2), loss_fn=mse_loss)
    assert result.ok and result.wrapper == "torch FSDP2", result.table()
    assert all(torch.equal(before[n], p.to_local()) for n, p in block.named_parameters())
    assert all(p.grad is None for p in block.parameters())
    doubled = preflight(block, _double, dense_batches(2), loss_fn=mse_loss)
    assert {c for p in doubled.params for c in p.anomalies} == {"grad_scaled"}
    assert all(p.fd_scale == pytest.approx(2.0, rel=0.02) for p in doubled.params)


def _scaled(name: str, factor: float, loss_fn: object = mse_loss) -> object:
    """A run whose micro-batch contribution to one FSDP2 parameter's reduced gradient is multiplied."""

    def run(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        p = dict(model.named_parameters())[name]
        before = None if p.grad is None else p.grad.to_local().clone()
        loss = loss_fn(model, batch)  # type: ignore[operator]
        loss.backward()
        g = p.grad.to_local()
        g.add_(g - (0 if before is None else before), alpha=factor - 1)
        return loss.detach()

    return run


def _mixed_mse(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return ((model(x).float() - y.float()) ** 2).mean()


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
def test_fsdp2_weights_are_judged_on_their_modules(gloo: None, precision: str) -> None:
    """Under FSDP2 the module computes with the unsharded parameter FSDP2 registers for the forward, not the
    sharded one the gradient is read from: the module-local check moves the former and compares with the
    latter, for a module inside the root's unit and for a module that is its own unit (whose shards are put
    back after its forward). With a mixed-precision policy the forward computes in bf16 from fp32 shards:
    no false alarm from the loss-level probe either."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    block = DenseBlock("plain", hidden=32)
    batches = [(x.bfloat16(), y.bfloat16()) for x, y in dense_batches(3, hidden=32)]
    if precision == "bf16":
        block = block.bfloat16()
        policy = MixedPrecisionPolicy()
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(block.mid, mp_policy=policy)
    fully_shard(block, mp_policy=policy)
    clean = preflight(block, _scaled("out.bias", 1.0, _mixed_mse), batches, loss_fn=_mixed_mse)
    assert clean.ok, clean.table()
    assert (
        clean.local["on"]
        and clean.local["verdicts"] == {"ok": clean.local["judged"]}
        and clean.local["judged"]
    )
    for name in ("mid.weight", "out.bias", "inp.weight"):
        result = preflight(block, _scaled(name, 3.0, _mixed_mse), batches, loss_fn=_mixed_mse)
        assert {p.name: p.anomalies for p in result.params if p.anomalies} == {name: ["grad_scaled"]}, (
            result.table()
        )
        target = next(p for p in result.params if p.name == name)
        assert target.fd_probe == f"module {name.split('.')[0]}" and target.fd_scale == pytest.approx(
            3.0, rel=0.02
        )


def test_torch_ddp(gloo: None) -> None:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(DenseBlock("plain"))
    assert type(choose(model)).__name__ == "Adapter"
    result = preflight(model, mse_microbatch, dense_batches(2), loss_fn=mse_loss)
    assert result.ok and [p.name for p in result.params][:2] == ["inp.weight", "inp.bias"]


# -- the CLI ---------------------------------------------------------------------------------------------------
SCRIPT = """
import sys, torch
sys.path.insert(0, {emulators!r})
from emulators import DenseBlock, MegatronFSDP, dense_batches, mse_loss, mse_microbatch
from maingrad.hooks.preflight.run import preflight_from_env

torch.manual_seed(0)
model = MegatronFSDP(DenseBlock(sys.argv[1]), sys.argv[2], unit_types=(), data_parallel_size=1)
preflight_from_env(model, mse_microbatch, dense_batches(2), loss_fn=mse_loss)
raise SystemExit("training started: preflight did not stop the script")
"""


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT.format(emulators=str(Path(__file__).parent))))
    return path


def test_cli_script_and_show(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("MAINGRAD_PREFLIGHT", "MAINGRAD_PREFLIGHT_JSON", "MAINGRAD_PREFLIGHT_SINKS"):
        monkeypatch.delenv(key, raising=False)
    script = _script(tmp_path)
    out = tmp_path / "pf.json"
    rc = cli_main(
        ["preflight", "--script", str(script), "--json", str(out), "--", "basic", "optim_grads_params"]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "grad_overwritten+grad_scaled" in err
    assert json.loads(out.read_text())["status"] == "fail"
    assert cli_main(["preflight", "--show", str(out)]) == 1
    assert "FAIL - Megatron-FSDP (optim_grads_params)" in capsys.readouterr().out
    assert cli_main(["preflight", "--script", str(script), "--", "te", "no_shard"]) == 0
    assert sys.argv[0] != str(script)  # restored
    assert "MAINGRAD_PREFLIGHT" not in os.environ and "MAINGRAD_PREFLIGHT_JSON" not in os.environ


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["preflight", "--script", str(tmp_path / "missing.py")]) == 2
    assert "no such script" in capsys.readouterr().err
    plain = tmp_path / "noop.py"
    plain.write_text("x = 1\n")
    assert cli_main(["preflight", "--script", str(plain)]) == 2
    assert "never called maingrad.hooks.preflight_from_env" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli_main(["preflight", "--show", str(bad)]) == 2


# -- the service's gate fails a commit whose preflight failed --------------------------------------------------
def test_service_gate_fails_on_preflight_records(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    sys.path.insert(0, str(Path(__file__).parents[1] / "service"))
    try:
        from fastapi.testclient import TestClient
        from svc_helpers import ADMIN, SECRET, admin_headers, ndjson, report, sha
    finally:
        sys.path.pop(0)
    from maingrad.contracts.records import end_marker
    from maingrad.service.app import create_app
    from maingrad.service.config import Settings

    def run(middle: str, strategy: str):
        torch.manual_seed(0)
        model = MegatronFSDP(DenseBlock(middle), strategy, unit_types=(), data_parallel_size=1)
        return preflight(model, mse_microbatch, dense_batches(2), loss_fn=mse_loss)

    failing, passing = run("basic", "optim_grads_params"), run("basic", "no_shard")
    assert failing.status == "fail" and passing.ok
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'svc.db'}",
        secret=SECRET,
        admin_token=ADMIN,
        public_dashboard=True,
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        r = client.post(
            "/api/v1/projects", json={"name": "pf", "default_branch": "main"}, headers=admin_headers()
        )
        assert r.status_code == 201, r.text
        r = client.post(
            "/api/v1/projects/pf/tokens",
            json={"scopes": ["upload", "read"], "name": "ci"},
            headers=admin_headers(),
        )
        auth = {"Authorization": f"Bearer {r.json()['token']}"}
        for n, result in ((1, failing), (2, passing)):
            commit = sha(f"pf{n}")
            client.post(
                "/api/v1/projects/pf/reports",
                params={"commit_sha": commit, "branch": "main"},
                json=report(),
                headers=auth,
            )
            records = result.records(run=f"preflight-{n}", commit=commit)
            r = client.post(
                f"/api/v1/projects/pf/runs/preflight-{n}/records", content=ndjson(records), headers=auth
            )
            assert r.status_code == 200, r.text
            # what preflight's sink sends when it closes: the run is complete only with its end marker
            r = client.post(
                f"/api/v1/projects/pf/runs/preflight-{n}/end",
                json=end_marker(f"preflight-{n}", rank=0, world_size=1, records=len(records), lost=0),
                headers=auth,
            )
            assert r.status_code == 200, r.text
        gate = client.get("/api/v1/projects/pf/gate", params={"commit_sha": sha("pf1")}, headers=auth).json()
        assert gate["status"] == "fail", gate
        assert gate["runtime"]["anomalies"] == 2  # mid.weight: overwritten and scaled
        assert {s["anomaly"] for s in gate["runtime"]["samples"]} == {"grad_overwritten", "grad_scaled"}
        assert {s["phase"] for s in gate["runtime"]["samples"]} == {"preflight"}
        cond = {c["name"]: c for c in gate["conditions"]}
        assert cond["runtime_anomalies"]["passed"] is False
        gate2 = client.get("/api/v1/projects/pf/gate", params={"commit_sha": sha("pf2")}, headers=auth).json()
        assert gate2["status"] == "pass" and gate2["runtime"]["records"] == 1, gate2
        # the dashboard shows the failing run's verdicts with no new endpoint
        run = client.get("/api/v1/projects/pf/runs/preflight-1", headers=auth).json()
        assert {(a["phase"], a["param"], a["anomaly"]) for a in run["anomalies"]} == {
            ("preflight", "weight", "grad_overwritten"),
            ("preflight", "weight", "grad_scaled"),
        }
        page = client.get("/projects/pf/runs/preflight-1")
        assert page.status_code == 200 and "grad_scaled" in page.text and "preflight" in page.text
