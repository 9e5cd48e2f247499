"""`python -m swiftkv_jax.convert SRC DST --to hf|orbax [--dtype ...]`: round trips, dtypes, side files, errors.

`main([...])` runs in-process for speed; one subprocess run proves the module entry point.
"""

import asyncio
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import torch
import uvloop
from transformers import LlamaForCausalLM

import swiftkv_jax as sk
from hf_models import file_digests, make_hf_model, random_tokens, read_hf_tensors, safetensors_header, torch_logits
from swiftkv_jax.convert import main

SIDECARS = {"tokenizer_config.json": '{"model_max_length": 2048, "tokenizer_class": "PreTrainedTokenizerFast"}\n',
            "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}\n',
            "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}\n"}


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(320, batch=2, length=96, seed=9)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """(path, fp32 torch model): a transformers Llama with tokenizer and generation files beside it."""
    path = tmp_path_factory.mktemp("src")
    torch_model = make_hf_model(path, "llama", seed=41, initializer_range=0.1, attention_bias=True)
    assert (path / "generation_config.json").is_file()  # written by save_pretrained
    for name, text in SIDECARS.items():
        (path / name).write_text(text)
    return path, torch_model


def run(argv, capsys):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_sidecars_copied(src_path, dst_path):
    for name in list(SIDECARS) + ["generation_config.json"]:
        assert (dst_path / name).read_bytes() == (src_path / name).read_bytes(), name


def test_hf_orbax_hf_round_trip_is_bit_identical(src, tmp_path, tokens, capsys):
    path, torch_model = src
    rc, out, err = run([path, tmp_path / "orbax", "--to", "orbax"], capsys)
    assert rc == 0, err
    assert "(hf) ->" in out and "(orbax)" in out and "tokenizer_config.json" in out
    assert sk.detect_format(tmp_path / "orbax") == "orbax"
    assert_sidecars_copied(path, tmp_path / "orbax")

    rc, out, err = run([tmp_path / "orbax", tmp_path / "hf", "--to", "hf"], capsys)
    assert rc == 0, err
    assert "(orbax) ->" in out
    assert_sidecars_copied(path, tmp_path / "hf")
    original, final = read_hf_tensors(path), read_hf_tensors(tmp_path / "hf")
    assert set(final) == set(original)
    for key, tensor in original.items():
        assert final[key].dtype == tensor.dtype and torch.equal(final[key], tensor), key
    np.testing.assert_array_equal(np.asarray(sk.logits(sk.load(tmp_path / "hf"), tokens)),
                                  np.asarray(sk.logits(sk.load(path), tokens)))
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    np.testing.assert_array_equal(torch_logits(reloaded, tokens), torch_logits(torch_model, tokens))


def test_swiftkv_student_round_trip_keeps_its_layout(src, tmp_path, tokens, capsys):
    student = sk.to_swiftkv(sk.load(src[0]), 2, 2)
    first = sk.save(student, tmp_path / "student", format="hf")
    assert run([first, tmp_path / "orbax", "--to", "orbax"], capsys)[0] == 0
    rc, out, err = run([tmp_path / "orbax", tmp_path / "hf", "--to", "hf"], capsys)
    assert rc == 0, err
    assert "SwiftKV l=2 g=2" in out
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((first / "config.json").read_text())
    before, after = read_hf_tensors(first), read_hf_tensors(tmp_path / "hf")
    assert set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    np.testing.assert_array_equal(np.asarray(sk.logits(sk.load(tmp_path / "hf"), tokens)),
                                  np.asarray(sk.logits(student, tokens)))


def test_dtype_bf16_writes_bf16_and_fp32_upcasts_back(src, tmp_path, capsys):
    path, _ = src
    rc, _, err = run([path, tmp_path / "bf16", "--to", "hf", "--dtype", "bf16"], capsys)
    assert rc == 0, err
    header = safetensors_header(tmp_path / "bf16" / "model.safetensors")
    header.pop("__metadata__")
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    original, halved = read_hf_tensors(path), read_hf_tensors(tmp_path / "bf16")
    for key, tensor in original.items():  # round to nearest even, like torch
        assert torch.equal(halved[key], tensor.to(torch.bfloat16)), key
    assert sk.load(tmp_path / "bf16").config.param_dtype == "bfloat16"

    rc, _, err = run([tmp_path / "bf16", tmp_path / "fp32", "--to", "hf", "--dtype", "fp32"], capsys)
    assert rc == 0, err
    back = read_hf_tensors(tmp_path / "fp32")
    for key, tensor in halved.items():
        assert back[key].dtype == torch.float32 and torch.equal(back[key], tensor.float()), key


def test_dtype_bf16_to_orbax(src, tmp_path, capsys):
    rc, _, err = run([src[0], tmp_path / "orbax", "--to", "orbax", "--dtype", "bf16"], capsys)
    assert rc == 0, err
    model = sk.load(tmp_path / "orbax")
    assert model.config.param_dtype == "bfloat16"
    assert {str(a.dtype) for a in jax.tree.leaves(model.params)} == {"bfloat16"}


def test_max_shard_size(src, tmp_path, capsys):
    rc, _, err = run([src[0], tmp_path / "out", "--to", "hf", "--max-shard-size", "200KB"], capsys)
    assert rc == 0, err
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert_sidecars_copied(src[0], tmp_path / "out")


def test_bad_src_is_exit_code_2_with_a_message(tmp_path, capsys):
    rc, out, err = run([tmp_path / "nowhere", tmp_path / "dst", "--to", "hf"], capsys)
    assert rc == 2
    assert err.startswith("error: ") and "nowhere" in err and "no such checkpoint directory" in err
    (tmp_path / "empty").mkdir()
    rc, _, err = run([tmp_path / "empty", tmp_path / "dst", "--to", "orbax"], capsys)
    assert rc == 2 and err.startswith("error: ") and "no config.json" in err
    assert not (tmp_path / "dst").exists()


def test_unsupported_model_and_bad_dtype_are_exit_code_2(src, tmp_path, capsys):
    bad = shutil.copytree(src[0], tmp_path / "mistral")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    rc, _, err = run([bad, tmp_path / "dst", "--to", "hf"], capsys)
    assert rc == 2 and err.startswith("error: ") and "unsupported model_type 'mistral'" in err
    rc, _, err = run([src[0], tmp_path / "dst", "--to", "hf", "--dtype", "int8"], capsys)
    assert rc == 2 and err.startswith("error: ") and "unknown dtype 'int8'" in err
    assert not (tmp_path / "dst").exists()


def test_bad_arguments_are_usage_errors(src, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(src[0]), str(tmp_path / "dst"), "--to", "bogus"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([str(src[0]), str(tmp_path / "dst")])
    assert exit_info.value.code == 2
    assert "--to" in capsys.readouterr().err


def test_a_shard_size_without_a_unit_names_the_flag(src, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(src[0]), str(tmp_path / "dst"), "--to", "hf", "--max-shard-size", "5"])
    assert exit_info.value.code == 2
    assert "--max-shard-size: '5' is not a size: give a number and a unit" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


def test_damaged_orbax_checkpoints_are_one_clear_error(src, tmp_path, capsys):
    """Data files cut short (e.g. a copy that ran out of space), or params/ gone: one line naming the directory and
    the fix, instead of Orbax's tracebacks from its reading threads."""
    rc, _, err = run([src[0], tmp_path / "orbax", "--to", "orbax"], capsys)
    assert rc == 0, err
    params = tmp_path / "orbax" / "params"
    for data in (params.glob("ocdbt.process_*/d/*"), params.glob("d/*")):  # the arrays' data, then the metadata
        for file in data:
            with open(file, "r+b") as f:
                f.truncate(100)
        rc, _, err = run([tmp_path / "orbax", tmp_path / "dst", "--to", "hf"], capsys)
        assert rc == 2 and err.startswith(f"error: {params}: cannot read this Orbax checkpoint ("), err
        assert err.rstrip().endswith("it is incomplete or corrupt: re-download or re-export the checkpoint")
    shutil.rmtree(params)
    rc, _, err = run([tmp_path / "orbax", tmp_path / "dst", "--to", "hf"], capsys)
    assert rc == 2 and "no params/" in err and "an incomplete Orbax checkpoint" in err
    assert not (tmp_path / "dst").exists()


def test_existing_dst_needs_overwrite(src, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("do not lose me\n")
    before = file_digests(dst)
    rc, _, err = run([src[0], dst, "--to", "hf"], capsys)
    assert rc == 2 and err.startswith("error: ") and "not empty" in err and "--overwrite" in err
    assert file_digests(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]

    rc, _, err = run([src[0], dst, "--to", "hf", "--overwrite"], capsys)  # not a checkpoint: not replaced
    assert rc == 2 and "holds files (keep.txt, ...) but no config.json: it is not one to replace" in err
    assert file_digests(dst) == before
    (dst / "config.json").write_text("{}")  # an (old) checkpoint's: --overwrite replaces it
    rc, _, err = run([src[0], dst, "--to", "hf", "--overwrite"], capsys)
    assert rc == 0, err
    assert not (dst / "keep.txt").exists()
    assert sk.detect_format(dst) == "hf"
    assert_sidecars_copied(src[0], dst)


def test_a_failed_write_is_one_clear_error_and_leaves_nothing(src, tmp_path, capsys, monkeypatch):
    """A full disk (safetensors' own error) or a DST under a file: exit 2 naming DST, no partial directory."""
    from safetensors import SafetensorError

    from swiftkv_jax.checkpoints import hf

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with monkeypatch.context() as m:
        m.setattr(hf, "save_file", full)
        rc, _, err = run([src[0], tmp_path / "out", "--to", "hf"], capsys)
    assert rc == 2 and f"error: cannot write {tmp_path / 'out'} (Error while serializing: I/O error: No space" in err
    assert "free space, or choose another DST" in err and "Traceback" not in err
    (tmp_path / "afile").write_text("x")
    rc, _, err = run([src[0], tmp_path / "afile" / "a" / "b", "--to", "hf"], capsys)
    assert rc == 2 and err.startswith("error: ") and "Traceback" not in err
    assert f"lies under {tmp_path / 'afile'}, which is a file, not a directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_bad_dtype_in_config_json_is_named_as_the_files(src, tmp_path, capsys):
    """No --dtype given: config.json's dtype is the one written, so a bad one names the file (it was reported as
    if --dtype had been given), and --dtype is the way round it."""
    bad = shutil.copytree(src[0], tmp_path / "int4")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "torch_dtype": "int4", "dtype": "int4"}))
    rc, _, err = run([bad, tmp_path / "dst", "--to", "orbax"], capsys)
    assert rc == 2 and f"error: {bad / 'config.json'}: unknown dtype 'int4'" in err and "or give --dtype" in err
    rc, _, err = run([bad, tmp_path / "dst", "--to", "orbax", "--dtype", "fp32"], capsys)
    assert rc == 0, err


def test_weights_that_are_not_floats_are_refused(src, tmp_path, capsys):
    """An int tensor was cast to float and trained on (its values truncated); the file and tensor are named."""
    from safetensors.numpy import load_file, save_file

    bad = shutil.copytree(src[0], tmp_path / "ints")
    file = next(bad.glob("*.safetensors"))
    tensors = load_file(file)
    name = next(n for n in tensors if n.endswith("down_proj.weight"))
    tensors[name] = tensors[name].astype(np.int32)
    save_file(tensors, file, metadata={"format": "pt"})
    rc, _, err = run([bad, tmp_path / "dst", "--to", "orbax"], capsys)
    assert rc == 2 and f"tensor {name} is stored as I32, not a float type" in err


def test_sigterm_while_writing_leaves_no_partial_directory(src, tmp_path):
    """A scheduler's SIGTERM mid-write: the shell's status 143, and the hidden partial DST removed."""
    script = (f"import os, signal, sys\n"
              f"from swiftkv_jax.checkpoints import hf\n"
              f"from swiftkv_jax.convert import main\n"
              f"real = hf.save_file\n"
              f"def killed(*args, **kwargs):\n"
              f"    os.kill(os.getpid(), signal.SIGTERM)\n"
              f"    return real(*args, **kwargs)\n"
              f"hf.save_file = killed\n"
              f"sys.exit(main([{str(src[0])!r}, {str(tmp_path / 'out')!r}, '--to', 'hf']))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_in_place_conversion_keeps_the_tokenizer_files(src, tmp_path, capsys):
    path = shutil.copytree(src[0], tmp_path / "ckpt")
    rc, _, err = run([path, path, "--to", "hf", "--dtype", "bf16", "--overwrite"], capsys)
    assert rc == 0, err
    assert sk.load(path).config.param_dtype == "bfloat16"
    assert_sidecars_copied(src[0], path)


def test_module_entry_point(src, tmp_path, tokens):
    result = subprocess.run(
        [sys.executable, "-m", "swiftkv_jax.convert", str(src[0]), str(tmp_path / "out"), "--to", "orbax",
         "--dtype", "fp32"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "(hf) ->" in result.stdout and "(orbax)" in result.stdout
    assert_sidecars_copied(src[0], tmp_path / "out")
    np.testing.assert_array_equal(np.asarray(sk.logits(sk.load(tmp_path / "out"), tokens)),
                                  np.asarray(sk.logits(sk.load(src[0]), tokens)))


def test_a_damaged_checkpoint_prints_one_line_up_to_the_exit(src, tmp_path, capsys):
    """After the clear error, Orbax's abandoned reads used to print dozens of tracebacks as the process ended (its
    closed event loop, its reader coroutines turning GeneratorExit into an Exception): the run, end to end, in a
    process of its own."""
    rc, _, err = run([src[0], tmp_path / "orbax", "--to", "orbax"], capsys)
    assert rc == 0, err
    for file in (tmp_path / "orbax" / "params").glob("ocdbt.process_*/d/*"):
        with open(file, "r+b") as f:
            f.truncate(100)
    result = subprocess.run([sys.executable, "-m", "swiftkv_jax.convert", str(tmp_path / "orbax"),
                             str(tmp_path / "dst"), "--to", "hf"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "dst").exists()


def _closed_loop_error(from_native: bool, new_loop) -> RuntimeError:
    """The error `call_soon_threadsafe` raises on a closed loop made by `new_loop`; from_native: with the traceback a
    native caller (TensorStore's callback) reports, which starts in `call_soon_threadsafe`, not in a Python caller."""
    loop = new_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        return e.with_traceback(e.__traceback__.tb_next) if from_native else e
    raise AssertionError("a closed loop accepted a callback")


@pytest.mark.parametrize("new_loop", [asyncio.SelectorEventLoop, uvloop.new_event_loop],
                         ids=["asyncio", "uvloop"])
def test_only_orbax_abandoned_reads_are_dropped(monkeypatch, new_loop):
    """The filter drops the two kinds of unraisable noise and hands anything else to the hook that was there, on
    asyncio's loops and on uvloop's (which Orbax gets once uvicorn has made it the loop policy: CI, 2026-11-27)."""
    from swiftkv_jax.checkpoints import orbax as orbax_checkpoints

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    orbax_checkpoints._drop_abandoned_read_noise()
    orbax_checkpoints._drop_abandoned_read_noise()  # once a process: not a second filter on the first

    async def reader():  # a coroutine of ours, not Orbax's, raising as Orbax's readers do
        pass

    coroutine = reader()
    try:
        raise GeneratorExit
    except GeneratorExit as stop:
        ours = Exception("read failed")
        ours.__cause__ = stop
    coroutine.close()
    closed_loop = _closed_loop_error(from_native=True, new_loop=new_loop)
    our_closed_loop = _closed_loop_error(from_native=False, new_loop=new_loop)
    other = RuntimeError("something else")
    for unraisable in (SimpleNamespace(exc_value=closed_loop, object=None),
                       SimpleNamespace(exc_value=our_closed_loop, object=None),
                       SimpleNamespace(exc_value=other, object=None),
                       SimpleNamespace(exc_value=ours, object=coroutine)):
        sys.unraisablehook(unraisable)
    assert [u.exc_value for u in seen] == [our_closed_loop, other, ours]
    assert orbax_checkpoints.is_abandoned_read_noise(SimpleNamespace(exc_value=closed_loop, object=None))


def test_only_orbax_abandoned_tasks_leave_asyncio_unlogged(monkeypatch):
    """Orbax's reader tasks and their gathering future, collected with their exceptions unread (asyncio logs each,
    many lines), are dropped from asyncio's logger once a read is guarded; anyone else's still reach its handlers.
    The tasks are real and collected as Orbax's are; the Orbax one's coroutine is compiled as a file of Orbax's."""
    import gc
    import logging

    from swiftkv_jax.checkpoints import orbax as orbax_checkpoints

    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # _drop_abandoned_read_noise replaces it
    logger = logging.getLogger("asyncio")
    monkeypatch.setattr(logger, "filters", list(logger.filters))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    gc.collect()  # an earlier test's unread task, collected here, would be logged as one of these
    logger.addHandler(handler)
    try:
        # the hook in place, then a logging setup that replaced the logger's filters: the next guarded read puts
        # its filter back
        orbax_checkpoints._drop_abandoned_read_noise()
        logger.filters.clear()
        with orbax_checkpoints.unreadable_orbax("ckpt"):
            pass
        source = "async def read():\n    raise ValueError('OUT_OF_RANGE')\n"
        for filename in (orbax_checkpoints.ORBAX_SOURCES + "checkpoint/reader.py", __file__):
            namespace = {}
            exec(compile(source, filename, "exec"), namespace)
            loop = asyncio.new_event_loop()
            task = loop.create_task(namespace["read"]())
            gathered = loop.run_until_complete(_gather_unread(namespace["read"]))
            loop.run_until_complete(asyncio.sleep(0))  # both ran and failed; nobody reads their exceptions
            loop.close()
            del task, gathered
            gc.collect()
        # plain futures failed as TensorStore fails them from native code (never raised: no traceback): its status
        # first (dropped), or anything else (kept); and one raised in Python with a status (kept)
        loop = asyncio.new_event_loop()
        futures = [loop.create_future() for _ in range(3)]
        futures[0].set_exception(ValueError('OUT_OF_RANGE: Error reading "w/0.0" in OCDBT database at local file'))
        futures[1].set_exception(ValueError("not a TensorStore status"))
        try:
            raise ValueError("DATA_LOSS: raised in Python")
        except ValueError as e:
            futures[2].set_exception(e)
        loop.close()
        del futures
        gc.collect()
    finally:
        logger.removeHandler(handler)
    firsts = sorted(r.getMessage().split("\n", 1)[0] for r in records)
    assert firsts == ["Future exception was never retrieved"] * 2 + [
        "Task exception was never retrieved", "_GatheringFuture exception was never retrieved"], firsts
    kept = sorted(str(r.exc_info[1]) for r in records if r.getMessage().startswith("Future"))
    assert kept == ["DATA_LOSS: raised in Python", "not a TensorStore status"], kept
    task_record = next(r for r in records if r.getMessage().startswith("Task"))
    assert f"defined at {__file__}" in task_record.getMessage()


async def _gather_unread(read):
    """A gathering future over one reader, failed and left unread (as Orbax's `asyncio.gather` of its reads is once
    the first fails)."""
    gathered = asyncio.gather(read())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    return gathered
