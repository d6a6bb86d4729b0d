"""Simulated acceptance length of an EAGLE-3 draft on prepared data, without vLLM: the method's
``simulator`` (:mod:`draftsmith.methods`), run by ``draftsmith simulate``
(:mod:`draftsmith.eval.simulate`, whose help says what is simulated and how)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def simulate(draft: Path, data_dir: Path, k: int = 3, temperatures: tuple[float, ...] = (0.0,),
             batch_size: int = 8, draft_sampling: str = "greedy") -> dict[str, Any]:
    """Validation metrics (``val_sim_al``, ``val_sim_rate_k``, ``val_loss_k``, ``val_acc_k``, ...)
    of ``draft`` over every sequence of ``data_dir``.

    ``data_dir`` may also be the run directory holding it (``RUN_DIR``). Errors name ``draft``
    and ``data_dir`` as given (never the temporary run directory the evaluation reads them
    through, nor the ``draft.init_from`` key it loads the draft with).

    Raises:
        WarmStartError: the draft is missing, unreadable or does not fit the data's target / aux
            layer ids.
        FileNotFoundError / ShardError: ``data_dir`` is not a prepared data folder.
    """
    import tempfile

    import torch
    from accelerate import Accelerator

    from ...layout import DRAFT_CONFIG_FILE
    from ...recipe import load_recipe
    from ...train.data import collate
    from ...train.validation import run_validation, validation_batches
    from .training import Eagle3Method
    from .warm_start import WarmStartError

    given = data_dir
    if not Path(draft).is_dir():
        raise WarmStartError(f"--draft {draft}: no such directory; pass an export (draftsmith export) or a "
                             "checkpoint (RUN_DIR/checkpoints/step-N)")
    if not any((Path(draft) / name).is_file() for name in ("config.json", DRAFT_CONFIG_FILE)):
        raise WarmStartError(f"--draft {draft}: neither an export (no config.json) nor a checkpoint (no "
                             f"{DRAFT_CONFIG_FILE}); pass an export (draftsmith export) or a checkpoint "
                             "(RUN_DIR/checkpoints/step-N)")
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(f"--data {data_dir}: no such directory; pass the RUN_DIR/data folder "
                                "`draftsmith prepare RECIPE --run-dir RUN_DIR` wrote")
    if not (Path(data_dir) / "target.json").is_file() and (Path(data_dir) / "data" / "target.json").is_file():
        data_dir = Path(data_dir) / "data"  # the run directory: its data folder
    if not (Path(data_dir) / "target.json").is_file():
        raise FileNotFoundError(f"--data {given}: not a prepared data folder (no target.json); pass the "
                                "RUN_DIR/data folder `draftsmith prepare RECIPE --run-dir RUN_DIR` wrote")
    data_dir = Path(data_dir).resolve()
    overrides = [f"draft.init_from={draft}", f"eval.num_speculative_tokens={k}",
                 f"train.eval_temperatures={list(temperatures)}", f"train.eval_draft_sampling={draft_sampling}",
                 f"draft.ttt_steps={k}", "data.hidden_states_mode=offline"]
    recipe = load_recipe(None, overrides)
    with tempfile.TemporaryDirectory(prefix="draftsmith-sim-") as tmp:
        (Path(tmp) / "data").symlink_to(data_dir)
        try:
            method = Eagle3Method(recipe, Path(tmp), vocab_from_init=True)
            model = method.build_model()
            acc = Accelerator(cpu=not torch.cuda.is_available())
            model = model.to(acc.device)
            method.setup(acc)
            dataset = method.dataset()
            batches = validation_batches(dataset, batch_size, collate, 1, 0)
            out = run_validation(method, model, batches, acc)
        except (WarmStartError, FileNotFoundError, RuntimeError, ValueError) as exc:
            # the data is read through tmp/data and the draft as draft.init_from: name what was given
            text = str(exc).replace(str(Path(tmp) / "data"), str(data_dir)).replace(str(Path(tmp)), str(data_dir))
            text = (text.replace("draft.init_from: ", f"--draft {draft}: ").replace("draft.init_from=", "--draft ")
                    .replace(" does not fit this run ", f" does not fit the data {data_dir} "))
            if text == str(exc):
                raise
            try:
                renamed = type(exc)(text)
            except Exception:  # an exception class that takes other arguments: keep it as it is
                raise exc from None
            raise renamed from None
    out.update(draft=str(draft), data=str(data_dir), num_sequences=len(dataset), k=k,
               temperatures=list(temperatures), draft_sampling=draft_sampling)
    return out
