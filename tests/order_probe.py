"""Run one import/apply/revert order for one patch in a fresh process and check it.

Usage: python tests/order_probe.py PATCH STEP [STEP ...] EXPECT
STEP is import | apply | revert; EXPECT is patched | original. ``import`` imports the
patch's target: the upstream module it patches late (coqui's ``trainer.trainer``)
and user modules that copied the patched names with ``from x import name`` (copies
under another name, ``import x as y``, are not rebound: the activation line comes first).
Exits 0 when every check holds, 1 with the failures listed.

``python tests/order_probe.py --serve`` is the same probe as a fork server: it imports what
every case imports first (torch, patches) and the heavy libraries that hold no patch site
(scipy, sympy, transformers' lazy root, torch's compiler stack), checks that no site module
came with them, then forks one child per case read from stdin. Each child starts from that
state, as a fresh interpreter would after its first imports, and costs a second instead of six.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import patches  # noqa: E402
from patches import _registry  # noqa: E402

USER_MODULE = '''
from torch.cuda.amp import autocast, GradScaler as CudaGradScaler, custom_fwd
from torch import GradScaler
from torch.nn.utils import clip_grad_norm_
'''

# Originals, taken from the modules that define them (never patched).
ORIGINALS = {
    ("torch.cuda.amp", "autocast"): torch.cuda.amp.autocast_mode.autocast,
    ("torch.cpu.amp", "autocast"): torch.cpu.amp.autocast_mode.autocast,
    ("torch.cuda.amp", "GradScaler"): torch.cuda.amp.grad_scaler.GradScaler,
    ("torch.cuda.amp", "custom_fwd"): torch.cuda.amp.autocast_mode.custom_fwd,
    ("torch.cuda.amp", "custom_bwd"): torch.cuda.amp.autocast_mode.custom_bwd,
    ("torch", "GradScaler"): torch.amp.grad_scaler.GradScaler,
    ("torch.amp", "GradScaler"): torch.amp.grad_scaler.GradScaler,
    ("torch.nn.utils", "clip_grad_norm_"): torch.nn.utils.clip_grad.clip_grad_norm_,
    ("torch.nn.utils.clip_grad", "clip_grad_norm_"): torch.nn.utils.clip_grad.clip_grad_norm_,
}
# name in the user module -> the site whose object it copied
USER_NAMES = {
    "autocast": ("torch.cuda.amp", "autocast"),
    "custom_fwd": ("torch.cuda.amp", "custom_fwd"),
    "GradScaler": ("torch", "GradScaler"),
    "clip_grad_norm_": ("torch.nn.utils", "clip_grad_norm_"),
}

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    if not ok:
        failures.append(what)


def do_import(patch: str) -> None:
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "probe_user_module.py"), "w") as handle:
        handle.write(USER_MODULE)
    with open(os.path.join(folder, "probe_user_cpu.py"), "w") as handle:
        handle.write("from torch.cpu.amp import autocast\n")
    sys.path.insert(0, folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module("probe_user_module")
        importlib.import_module("probe_user_cpu")
        importlib.import_module("trainer.trainer")
        for site in _registry.sites_of(patch):
            importlib.import_module(site.module)


def future_warnings(fn) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return sum(issubclass(w.category, FutureWarning) for w in caught)


PATCHES_DIR = os.path.dirname(os.path.abspath(patches.__file__))


def is_ours(value: object) -> bool:
    """Made by training-patches (wraps() copies names, not the code's file)."""
    value = getattr(value, "func", value)
    if isinstance(value, type):
        return value.__module__.startswith("patches")
    code = getattr(value, "__code__", None)
    return bool(code) and code.co_filename.startswith(PATCHES_DIR)


def serving(site, patch: str) -> bool:
    """Whether the site's one replacement is in place for ``patch`` now."""
    state = _registry._sites.get(site.key)
    return state is not None and patch in state.patches


def check_sites(patch: str, patched: bool) -> None:
    # the generic sites that serve the patch (torch.cuda.amp.GradScaler: grad_scaler's too)
    generic = [site for spec in _registry.specs().values() for site in spec.sites
               if patch in site.serves]
    for site in generic:
        if site.module not in sys.modules:
            continue
        value = _registry._current(site, sys.modules[site.module])
        if site.key not in ORIGINALS and site.key != ("trainer.trainer", "GradScaler"):
            check(serving(site, patch) == patched, f"{site} serves {patch}: {not patched}")
            check(is_ours(value) == patched, f"{site} is {'not ' if patched else ''}ours")
            if patched:
                # A class names what it wraps (SafeShardedGradScaler: FSDP's class, while
                # SafeGradScaler is a base by design), else its bases are what it wraps.
                below = ([value.__wrapped__] if hasattr(value, "__wrapped__") else
                         value.__bases__ if isinstance(value, type) else [value.__wrapped__])
                check(not any(is_ours(b) for b in below), f"{site} wraps ours (double wrap)")
            continue
        if site.key in ORIGINALS:
            original = ORIGINALS[site.key]
        else:  # trainer.trainer.GradScaler: a partial over torch's class
            original = None
            check(getattr(value, "func", None) is not None, f"{site} is not a partial")
            value = value.func
            original = torch.amp.grad_scaler.GradScaler
        if patched:
            check(serving(site, patch), f"{site} does not serve {patch}")
            check(value is not original, f"{site} is still the original")
            wrapped = getattr(value, "__wrapped__", None)
            check(wrapped is None or wrapped is original,
                  f"{site}.__wrapped__ is {wrapped!r}, not the original (double wrap)")
        else:
            check(value is original, f"{site} is {value!r}, not the original {original!r}")


def check_user_module(patch: str, patched: bool) -> None:
    user = sys.modules.get("probe_user_module")
    if user is None:
        return
    spec_keys = {site.key for site in _registry.sites_of(patch)}
    names = [(user, name, key) for name, key in USER_NAMES.items()]
    names.append((sys.modules["probe_user_cpu"], "autocast", ("torch.cpu.amp", "autocast")))
    for module, name, key in names:
        if key not in spec_keys:
            continue
        value = module.__dict__[name]
        if patched:
            check(value is not ORIGINALS[key], f"user module's {name} is still the original")
        else:
            check(value is ORIGINALS[key], f"user module's {name} is not the original")


def check_behaviour(patch: str, patched: bool) -> None:
    if patch == "autocast":
        def use() -> None:
            with torch.cuda.amp.autocast(enabled=False):
                pass
            with torch.cpu.amp.autocast():
                pass
            torch.cuda.amp.GradScaler(enabled=False)
        n = future_warnings(use)
        check((n == 0) if patched else (n > 0), f"{n} FutureWarnings from deprecated AMP names")
    elif patch == "grad_scaler":
        import trainer.trainer as tt
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scaler = tt.GradScaler()
            cpu_scaler = torch.amp.GradScaler("cpu")
        is_safe = isinstance(scaler, patches.advanced.SafeGradScaler)
        check(is_safe == patched, f"trainer.trainer.GradScaler() built {type(scaler)}")
        check(isinstance(scaler, torch.amp.grad_scaler.GradScaler), "not a torch GradScaler")
        expected_scale = 1024.0 if patched else 65536.0
        check(cpu_scaler._init_scale == expected_scale,
              f"torch.amp.GradScaler('cpu') init_scale {cpu_scaler._init_scale}")
    elif patch == "grad_clip":
        good = torch.nn.Parameter(torch.ones(3))
        bad = torch.nn.Parameter(torch.ones(3))
        good.grad = torch.ones(3)
        bad.grad = torch.tensor([1.0, float("nan"), 1.0])
        torch.nn.utils.clip_grad_norm_([good, bad], 1.0)
        intact = bool(torch.equal(good.grad, torch.ones(3)))
        check(intact == patched, f"finite gradient after a NaN norm: {good.grad.tolist()}")
    elif patch == "nan_guard":
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        (model(torch.ones(2, 3)).sum() * float("nan")).backward()
        opt.step()
        finite = bool(torch.isfinite(model.weight).all())
        check(finite == patched, f"weights finite after a NaN step: {finite}")
    elif patch == "anomaly":
        check(torch.is_anomaly_enabled() == patched,
              f"anomaly mode is {torch.is_anomaly_enabled()}")


def main(argv: list[str]) -> int:
    patch, *steps, expect = argv
    for step in steps:
        if step == "import":
            do_import(patch)
        elif step == "apply":
            patches.advanced.apply([patch])
        elif step == "revert":
            patches.revert([patch])
        else:
            raise SystemExit(f"unknown step {step}")
    patched = expect == "patched"
    check(patches.advanced.is_applied(patch) == patched, f"is_applied({patch}) is not {patched}")
    check_sites(patch, patched)
    check_user_module(patch, patched)
    check_behaviour(patch, patched)
    if failures:
        print("\n".join(failures))
        return 1
    print("ok")
    return 0


# Imported by the server before any case: none holds a patch site nor imports one (serve()
# checks), so every order still imports each site where the case says.
PRELOAD = ("numpy", "scipy.signal", "scipy.optimize", "scipy.stats", "sympy", "matplotlib.axes",
           "torchmetrics", "transformers", "tokenizers", "safetensors", "huggingface_hub",
           "einops", "librosa", "coqpit", "TTS.utils.import_utils", "torch.distributed.tensor",
           "torch._dynamo", "torch._inductor.compile_fx", "torch._functorch.aot_autograd",
           "torch.export",
           # what the trainers' sites import (3.4 of the 4.9 s a case takes to import every
           # site): F5-TTS's text front end, coqui's audio, transformers' and DeepSpeed's
           "pandas", "wandb", "numba", "num2words", "pypinyin", "rjieba", "torchaudio",
           "soundfile", "loguru", "fsspec", "joblib", "einx", "x_transformers", "ema_pytorch",
           "torchdiffeq", "datasets")


def serve() -> int:
    """Fork one child per request line ``{"argv": [...], "out": FILE, "cwd": DIR}``; answer
    ``{"rc": N}`` when it ends. A child past 300 s is killed (rc -9)."""
    import json
    import time

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # an optional library this machine lacks: its site cases import it later
    before = sorted(site.module for name in _registry.specs() for site in _registry.sites_of(name)
                    if site.module in sys.modules and not site.module.startswith("torch"))
    if before or "trainer.trainer" in sys.modules:
        print(json.dumps({"error": f"preloading imported patch sites {before}"}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the case
            code = 1
            try:
                os.chdir(request["cwd"])
                fd = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                code = main(request["argv"])
            except BaseException:  # noqa: BLE001 - the case's own failure, written out
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + 300
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                rc = -9
                break
            time.sleep(0.02)
        print(json.dumps({"rc": rc}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(serve() if sys.argv[1:] == ["--serve"] else main(sys.argv[1:]))
