"""Audio of one clip: decoded (soundfile, torchcodec as a fallback) and measured
(:func:`signal_stats`), in a pool of worker processes that end with the command."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Iterator, Sequence

# -- signal thresholds (documented in signal_stats) --------------------------------------

FRAME_SECONDS = 0.020
FULL_SCALE = 0.999        # |x| at or above this (of 1.0) counts as a clipped sample
SILENCE_DBFS = -50.0      # a frame quieter than this (RMS) is silence


def _decode(path: str) -> tuple[Any, int, str]:
    """(samples float32 [frames, channels], sample rate, decoder) of an audio file."""
    import numpy as np  # lazy: numpy may be missing: command._check_installed says so first
    import soundfile as sf  # lazy: soundfile is optional (the tools extra)

    try:
        data, rate = sf.read(path, dtype="float32", always_2d=True)
        return data, int(rate), "soundfile"
    except sf.LibsndfileError as sf_error:
        try:
            from torchcodec.decoders import AudioDecoder  # lazy: torchcodec is optional
        except Exception:  # noqa: BLE001 - no fallback installed: soundfile's word stands
            raise sf_error from None
        try:
            samples = AudioDecoder(path).get_all_samples()
        except Exception as exc:  # noqa: BLE001 - report both decoders' reasons
            raise RuntimeError(f"soundfile: {sf_error}; torchcodec: {exc}") from None
        data = np.ascontiguousarray(samples.data.numpy().T, dtype=np.float32)
        return data, int(samples.sample_rate), "torchcodec"


def signal_stats(data: Any, rate: int) -> dict[str, Any]:
    """Clipping ratio, silence ratio and an SNR estimate of decoded audio.

    - clipping ratio: the share of samples (all channels) with ``|x| >= 0.999`` of full scale.
      Audio that was clipped and then scaled down is not seen; one peak-normalised sample is
      not counted as clipping by the 0.1 % limit.
    - silence ratio: the share of 20 ms frames of the mono mix whose RMS is under -50 dBFS.
    - SNR estimate (dB): the 95th percentile of the frames' RMS level minus their 10th
      percentile, i.e. speech level over the noise floor heard in the pauses. Speech has
      pauses, so the quiet frames are noise; a clip with no pause at all reads low. None
      for clips under 10 frames or with no frame above -50 dBFS.
    """
    import numpy as np  # lazy: numpy may be missing: command._check_installed says so first

    mono = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    clipping = float(np.count_nonzero(np.abs(data) >= FULL_SCALE)) / max(data.size, 1)
    hop = max(int(rate * FRAME_SECONDS), 1)
    frames = len(mono) // hop
    if frames == 0:
        return {"clipping_ratio": round(clipping, 6), "silence_ratio": 1.0, "snr_db": None}
    framed = mono[: frames * hop].astype(np.float64).reshape(frames, hop)
    rms = np.sqrt(np.mean(framed * framed, axis=1))
    level = 20.0 * np.log10(np.maximum(rms, 1e-10))
    silence = float(np.count_nonzero(level < SILENCE_DBFS)) / frames
    snr = None
    if frames >= 10 and level.max() >= SILENCE_DBFS:
        snr = float(min(np.percentile(level, 95) - np.percentile(level, 10), 100.0))
    return {"clipping_ratio": round(clipping, 6), "silence_ratio": round(silence, 4),
            "snr_db": None if snr is None else round(snr, 1)}


def analyse_audio(path: str) -> dict[str, Any]:
    """What the audio checks need from one file; ``{"failure": (reason, detail)}`` if none.

    Runs in a worker process: only picklable values go back.
    """
    if not os.path.exists(path):
        return {"failure": ("missing_file", f"{path} does not exist")}
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        return {"failure": ("unreadable", f"{path} is not a readable file")}
    try:
        data, rate, decoder = _decode(path)
    except OSError as exc:
        return {"failure": ("unreadable", f"{type(exc).__name__}: {exc}")}
    except Exception as exc:  # noqa: BLE001 - any decoder error is this file's reason
        return {"failure": ("decode_failure", f"{type(exc).__name__}: {str(exc)[:300]}")}
    if data.shape[0] == 0 or rate <= 0:
        return {"failure": ("decode_failure", "the file holds no audio samples")}
    result = {"duration_s": round(data.shape[0] / rate, 3), "sample_rate": rate,
              "channels": int(data.shape[1]), "decoder": decoder}
    result.update(signal_stats(data, rate))
    return result


def analyse_many(paths: Sequence[str], workers: int) -> Iterator[dict[str, Any]]:
    """:func:`analyse_audio` for each path, in order, over ``workers`` processes.

    The workers end with the generator: when it is closed early or an exception (a
    signal's :class:`~patches.tools._output.Interrupted`) passes through it, they are terminated
    at once instead of finishing the queue, so nothing outlives the command holding its
    stdout."""
    if workers <= 1 or len(paths) < 2:
        yield from map(analyse_audio, paths)
        return
    # fork: the workers inherit the imported modules instead of importing torch again
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    chunk = max(1, min(16, len(paths) // (workers * 8)))
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                               initializer=_worker_init)
    try:
        yield from pool.map(analyse_audio, paths, chunksize=chunk)
    except BaseException:
        _stop_workers(pool)
        raise
    pool.shutdown(wait=True)


def _worker_init() -> None:
    """In each worker: Ctrl-C is the command's to handle (the terminal sends it to the whole
    process group), SIGTERM kills, and (Linux) the worker gets SIGTERM if the command dies
    without ending it (SIGKILL)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no libc symbol: the parent still ends them
            pass


def _stop_workers(pool: Any) -> None:
    """Terminate a ProcessPoolExecutor's workers now (running and queued work dropped)."""
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14+
    if terminate is not None:
        terminate()
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
