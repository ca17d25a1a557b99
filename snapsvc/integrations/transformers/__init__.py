"""Asynchronous checkpoints for the Hugging Face ``transformers`` Trainer.

:class:`SnapsvcTrainer` is a drop-in ``transformers.Trainer`` (written against
5.24) whose ``_save_checkpoint`` stages the model, optimizer, scheduler,
gradient scaler, RNG states (torch, cuda, python, numpy) and trainer state in
one :meth:`SnapshotWriter.submit` and returns; the writer sidecar writes them.

Layout. A committed ``checkpoint-<step>/`` holds::

    snapsvc_state.fdl        the tensors of the model, optimizer and scaler: flodl's format
    snapsvc_state.fdl.data   the torch RNG states (uint8), in its framing (docs/format.md)
    snapsvc_state.fdl.meta   the state tree and non-tensor leaves (msgpack)
    trainer_state.json       HF's own file, which train() and HF tools read
    config.json ...          the rest of what the stock Trainer writes beside the
                             weights, by HF's own writers: the model's config (with
                             its architectures and dtype), generation_config.json,
                             the tokenizer's or processor's files, a remote-code
                             model's source

One state file plus HF's own files, not HF's layout, because the sidecar
writes ``.fdl`` files and never pickles: ``optimizer.pt``, ``scheduler.pt``
and ``rng_state.pth`` are pickles, so HF's layout would mean writing them in
the training process, which is the stall this class removes (``training_args.bin``,
a pickle of the TrainingArguments that no resume reads, is not written). The cost: a
stock ``Trainer`` cannot resume from these directories (``SnapsvcTrainer``
resumes from both kinds; once this module is imported, the stock one's error
says so instead of only "Can't find a valid checkpoint"), and ``from_pretrained`` needs the weights exported
(``snapsvc.load(path)["model"]``). Python's and numpy's RNG states become
state-API values (tuples, ints, bytes) and are rebuilt on load.

Completeness. transformers 5.24 has no incomplete-checkpoint marker:
``get_last_checkpoint`` takes the highest ``checkpoint-<N>`` directory and
``rotate_checkpoints`` globs ``checkpoint-*``. So a checkpoint is written into
a hidden ``.snapsvc-checkpoint-<N>`` directory, which neither matches, and a
committer thread renames it to ``checkpoint-<N>`` only after the sidecar
reported the state file and its metadata durable and HF's files and the
directory were fsynced; then it fsyncs the run directory. A directory still
being written, or left by a crash, is never under a name HF (or
``resume_from_checkpoint=True``) picks; leftovers are removed at the next
save. Because no write ever targets a ``checkpoint-*`` directory, rotation
(HF's own ``rotate_checkpoints``, run by the committer right after each
commit with the arguments the stock Trainer would pass) can neither delete a
pending write nor keep a half-written one, so per-file waits and removal
(``SnapshotWriter.wait_path``, ``snapsvc.checkpoint_files``) are not needed.
``load_best_model_at_end`` and the end-of-training pruning run after the
pending commits (``_finalize_training`` drains first).

``snapsvc_options={"overlap": True}``: ``_save_checkpoint`` returns before
the parameters and optimizer state are copied; the trainer guards its
optimizer so that the next step waits for the copy.

Backpressure. A save needs a free slot; while every slot holds a checkpoint
the sidecar is still writing, it waits (policy "block": as with the stock
Trainer, no checkpoint is dropped). The first save that waits longer than it
copies logs a warning with the write's figures and the knobs (``save_steps``,
``nice``, ``slots``). On a CPU run the sidecar runs at training's priority
(the writer's default ``nice``: see :class:`~snapsvc.SnapshotWriter`).

Callbacks. ``on_save`` runs right after a save returns, and callbacks read
``checkpoint-<N>`` there (transformers' ``WandbCallback``, ``MLflowCallback``,
``ClearMLCallback``, ``NeptuneCallback`` and ``FlyteCallback`` upload it). When
a callback overrides ``on_save``, the save waits until its directory is
committed, so the callback finds it complete, as with the stock Trainer: such
runs stall for the write; the default callbacks do not override it. Under
torchrun the main process renames the directory, so only its callbacks are
sure to see it (the integrations above upload from the main process only).

Errors. A failed write (disk error, dead sidecar) removes its hidden
directory and raises at the next save, or when training ends, as
:class:`WriteFailedError`, :class:`BrokenWriterError` or (several
processes) :class:`DistributedCheckpointError`, naming the checkpoint.
``save_model``, the end of training and :meth:`close` wait for pending
commits (at most :attr:`SnapsvcTrainer.drain_timeout` seconds), and so does a
``train()`` that raises (an error, a callback's, Ctrl-C: a second Ctrl-C
abandons them) before its exception goes on: as with the stock Trainer, every
checkpoint saved before the failure is on disk for ``get_last_checkpoint`` or
``train(resume_from_checkpoint=True)`` right after.

Several processes (torchrun, DDP). Each rank submits its part through its
own sidecar with :class:`snapsvc.DistributedSnapshotWriter`: rank 0 (HF's
main process) the model, optimizer, scheduler, scaler, trainer state and its
RNG states, every other rank its RNG states, into
``<output_dir>/.snapsvc-ranks/step_<N>/rank<r>.fdl``. That writer commits
the step with its manifest once every rank's file is durable; then the main
process writes HF's JSON files there, fsyncs them and renames the directory
to ``checkpoint-<N>`` (same filesystem). On resume every rank loads rank 0's
file and its own RNG states, as the stock Trainer loads ``model.safetensors``
and ``rng_state_<r>.pth``. ``output_dir`` must be shared by the ranks.

FSDP2 (accelerate's ``fsdp_version=2``). Parameters and optimizer state are
DTensors on every rank, so every rank submits the whole state (model,
optimizer, scheduler, scaler, trainer state, and every rank's RNG states,
gathered into one list) with one structure; each rank stages its own shards
(``DistributedSnapshotWriter.submit(state, step)``), into the same
``.snapsvc-ranks/step_<N>`` directory, committed and renamed as above. A
resume restores model, optimizer and scheduler in one
:func:`snapsvc.restore_distributed` (resharded to this run's placements) and
each rank's RNG states from that list: bit-exact at the same world size.
accelerate 1.15 runs FSDP only on GPUs and other accelerators (on CPU it
drops the plugin and the Trainer runs DDP); tests/test_hf_fsdp.py lifts that
check to run this path on CPU with gloo.

Not covered, each falling back to the stock (synchronous) save with a
warning that says why: DeepSpeed, FSDP1, XLA, SageMaker MP, ``push_to_hub``,
and runs of several processes that are not torch.distributed.

What each module holds::

    trainer.py   SnapsvcTrainer: its saves, through one submit per checkpoint
    resume.py    its resumes (the loading half), and RNG states as state-API values
    commit.py    its committer thread: a checkpoint-<N> directory appears whole or not at all
"""

try:  # the extra's packages, named before anything of ours needs them
    import accelerate  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:
    raise ImportError(f"snapsvc.transformers needs transformers and accelerate ({e.name} is "
                      "missing): pip install 'snapsvc[transformers]'") from e

from .commit import STAGING_PREFIX  # noqa: E402
from .trainer import STATE_FILE, SnapsvcTrainer  # noqa: E402

__all__ = ["SnapsvcTrainer", "STATE_FILE", "STAGING_PREFIX"]
