"""Training runs that can be trusted for days (train/train_state.py): a resume compares its settings with the
checkpoint's, a checkpoint is one unit (a kill between its writes resumes exactly), the log has each step once,
every record trains (none without room for a block), and a bad file is one line naming it."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_models import BLOCK, one_thread, tiny_target_dir, write_train_data

import dspark.draft.checkpoint
import dspark.train.train_state
from dspark.cli import main
from dspark.train.trainer import TrainConfig, Trainer

__all__ = ["one_thread", "tiny_target_dir"]  # fixtures used here
pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 3  # killed runs stop during step STEPS + 1 of 2 * STEPS


class Killed(Exception):
    pass


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    lengths = [(3 + i % 5, 8 + (i * 7) % 30) for i in range(10)]
    return write_train_data(tmp_path_factory.mktemp("data") / "regen.jsonl", lengths)


def config(data, out, target, **fields) -> TrainConfig:
    base = dict(target=str(target), target_dtype="fp32", num_layers=1, block_size=BLOCK, markov_rank=8,
                num_anchors=4, max_len=48, batch_size=2, steps=2 * STEPS, lr=3e-3, warmup=2, save_every=1,
                eval_every=100, eval_sequences=2)
    return TrainConfig(data=str(data), out=str(out), **{**base, **fields})


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}


def kill_at_step(trainer: Trainer, step: int):
    """Make trainer.fit raise Killed in optimizer step number `step` (after its backward)."""
    real = trainer.opt.step

    def step_or_die(*args, **kwargs):
        if trainer.step + 1 >= step:
            raise Killed
        return real(*args, **kwargs)

    trainer.opt.step = step_or_die


def log_steps(folder) -> list[int]:
    return [json.loads(r)["step"] for r in (folder / "train_log.jsonl").read_text().splitlines()]


def test_a_resume_with_changed_settings_is_refused_unless_allowed_and_then_recorded(tiny_target_dir, data, tmp_path,
                                                                                     capsys):
    run = tmp_path / "run"
    Trainer(config(data, run, tiny_target_dir, steps=2)).fit()
    with pytest.raises(ValueError, match=r"other settings \(lr: 0.003 there, 0.001 now"):
        Trainer(config(data, run, tiny_target_dir, steps=2, lr=1e-3))
    with pytest.raises(ValueError, match="another drafter .num_layers: 1 there, 2 now"):
        Trainer(config(data, run, tiny_target_dir, steps=2, num_layers=2, allow_changes=True))
    grown = tmp_path / "grown.jsonl"
    grown.write_text(data.read_text() + data.read_text().splitlines(keepends=True)[0].replace("rec/0", "rec/new"))
    with pytest.raises(ValueError, match="data_sha256"):
        Trainer(config(grown, run, tiny_target_dir, steps=2))
    moved = tmp_path / "moved.jsonl"
    shutil.copy(data, moved)
    capsys.readouterr()
    assert Trainer(config(moved, run, tiny_target_dir, steps=2, save_every=7)).step == 2  # same data, free setting
    assert f"resumed {run} from step 2" in capsys.readouterr().err

    longer = Trainer(config(data, run, tiny_target_dir, steps=4, lr=1e-3, allow_changes=True))
    assert "settings changed: steps: 2 there, 4 now, lr: 0.003 there, 0.001 now" in capsys.readouterr().err
    longer.fit()
    state = torch.load(run / "train_state.pt", weights_only=False)
    assert state["changes"] == [{"field": "steps", "was": 2, "now": 4, "step": 2},
                                {"field": "lr", "was": 0.003, "now": 0.001, "step": 2}]
    assert main(["export", "--drafter", str(run), "--out", str(tmp_path / "ship"), "--target", str(tiny_target_dir)]) == 0
    shipped = json.loads((tmp_path / "ship" / "training.json").read_text())
    assert shipped["config"]["lr"] == 1e-3 and shipped["changes"] == state["changes"]


def test_a_kill_between_a_checkpoints_writes_resumes_exactly(tiny_target_dir, data, tmp_path, monkeypatch, capsys):
    """The run is killed after the first of a checkpoint's files landed and before the second: whichever order
    they are written in, the resumed run ends where the uninterrupted one does."""
    whole = Trainer(config(data, tmp_path / "whole", tiny_target_dir))
    whole.fit()
    killed = Trainer(config(data, tmp_path / "killed", tiny_target_dir))
    real = dspark.draft.checkpoint.atomic_write
    landed = []

    def torn(path, write):
        if killed.step == STEPS + 1 and path.name in ("model.safetensors", "train_state.pt"):
            if landed:
                raise Killed
            landed.append(path.name)
        return real(path, write)

    for module in (dspark.draft.checkpoint, dspark.train.train_state, dspark.train.trainer):
        if getattr(module, "atomic_write", None) is real:
            monkeypatch.setattr(module, "atomic_write", torn)
    with pytest.raises(Killed):
        killed.fit()
    monkeypatch.undo()
    resumed = Trainer(config(data, tmp_path / "killed", tiny_target_dir))
    resumed.fit()
    assert resumed.step == whole.step == 2 * STEPS
    for name, tensor in weights(whole).items():
        assert torch.equal(weights(resumed)[name], tensor), name
    assert log_steps(tmp_path / "killed") == list(range(1, 2 * STEPS + 1))


def test_the_log_holds_each_step_once_after_a_resume(tiny_target_dir, data, tmp_path, capsys):
    """Saved every 2 steps, killed in step 4: step 3's row was logged after the last checkpoint and is dropped."""
    cfg = config(data, tmp_path / "run", tiny_target_dir, save_every=2)
    first = Trainer(cfg)
    kill_at_step(first, STEPS + 1)
    with pytest.raises(Killed):
        first.fit()
    assert log_steps(tmp_path / "run") == [1, 2, 3]
    Trainer(cfg).fit()
    assert "(1 log rows after it dropped)" in capsys.readouterr().err
    assert log_steps(tmp_path / "run") == list(range(1, 2 * STEPS + 1))


def test_records_without_room_for_a_block_are_left_out_with_a_message(tiny_target_dir, tmp_path, capsys):
    data = write_train_data(tmp_path / "d.jsonl", [(46, 10)] * 3 + [(4, 20)] * 9)  # 3 prompts fill --max-len 48
    trainer = Trainer(config(data, tmp_path / "run", tiny_target_dir, steps=3))
    assert "3 of 12 records leave no room for a block of 4 within --max-len 48" in capsys.readouterr().err
    assert all(len(r["ids"]) - 1 - BLOCK >= r["start"] for r in trainer.records)
    rows = [trainer.train_step() for _ in range(3)]
    assert all(row["loss"] > 0 for row in rows)


def one_error_line(capsys, *names) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dspark: error: "), err
    assert all(name in err for name in names), err
    return err


def test_bad_files_give_one_line_naming_the_file(tiny_target_dir, data, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--data", str(data), "--out", str(run), "--target", str(tiny_target_dir), "--num-layers", "1",
            "--block-size", str(BLOCK), "--markov-rank", "8", "--num-anchors", "4", "--max-len", "48", "--steps", "1",
            "--eval-sequences", "2", "--target-dtype", "fp32"]
    assert main(argv) == 0
    capsys.readouterr()
    export = ["export", "--drafter", str(run), "--out", str(tmp_path / "ship"), "--target", str(tiny_target_dir)]

    state = run / "train_state.pt"
    saved = state.read_bytes()
    state.write_bytes(saved[: len(saved) // 2])  # torn
    assert main(argv) == 2
    one_error_line(capsys, str(state), "not a readable training checkpoint")
    assert main(export) == 2
    one_error_line(capsys, str(state))
    state.write_bytes(saved)

    view = run / "model.safetensors"
    good = view.read_bytes()
    view.write_bytes(good[: len(good) // 2])
    assert main(export) == 2
    one_error_line(capsys, str(view), "not a readable safetensors file")
    view.write_bytes(good)

    cfg_path = run / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "block_size": "4"}))
    assert main(export) == 2
    one_error_line(capsys, str(cfg_path), "block_size must be int, got '4'")
    cfg_path.write_text("{not json")
    assert main(export) == 2
    one_error_line(capsys, str(cfg_path), "not valid JSON")

    bad = tmp_path / "bad.jsonl"
    lines = data.read_text().splitlines(keepends=True)
    bad.write_text("".join(lines[:2]) + '{"id": "x", "prompt_ids": [1, 2]}\n' + "".join(lines[2:]))
    assert main([*argv[:2], str(bad), "--out", str(tmp_path / "other"), *argv[5:]]) == 2
    one_error_line(capsys, f"{bad}:3", "no 'answer_ids'")
    bad.write_text("".join(lines[:4]) + '{"id": "x", "prompt_ids": [1, \n')
    assert main([*argv[:2], str(bad), "--out", str(tmp_path / "other"), *argv[5:]]) == 2
    one_error_line(capsys, f"{bad}:5")
