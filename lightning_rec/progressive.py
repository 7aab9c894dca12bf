"""Progressive evaluation: every training batch scored by the model before the step that trains on it, the scores
summed up per period of time (AUROC, normalized entropy, log loss), as a model trained on a stream is judged.

Each period's rows are new to the model when they are scored (the model has trained on the periods before it, and on
the batches of the same period before the batch), so the numbers say how well the model predicts what comes next,
without a held-out split. With :class:`~lightning_rec.data.TabularDataModule`'s ``period`` the periods are its
calendar periods (or row counts) in time order; on other data, every ``every_n_batches`` batches.

Example::

    dm = TabularDataModule(schema=..., train="events/", stream=True, period="week", time_column="ts")
    progressive = ProgressiveEvaluation()
    trainer = L.Trainer(strategy="recshard", callbacks=[progressive], max_epochs=1)
    trainer.fit(model, dm)
    progressive.history[0]   # {'epoch': 0, 'period': 0, 'start': '1997-09-15T00:00:00+00:00', ..., 'auroc': 0.61, ...}
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torchmetrics import MetricCollection
from torchmetrics.aggregation import SumMetric
from torchmetrics.classification import BinaryAUROC

from lightning_rec.metrics import LogLoss, NormalizedEntropy

__all__ = ["ProgressiveEvaluation", "batch_labels"]

_LABEL_KEYS = ("label", "labels", "target", "targets", "y")


def batch_labels(batch: Any) -> torch.Tensor:
    """The labels of a training batch, as the models here and users' models hold them: a TorchRec ``Batch``'s
    ``labels``; a dict's ``label``/``labels``/``target``/``targets``/``y``; a tuple's or list's last element.

    Raises:
        ValueError: a batch of another kind, naming its type (pass ``predict=`` to
            :class:`ProgressiveEvaluation`).

    Example::

        >>> batch_labels({"sparse": None, "label": torch.tensor([1.0, 0.0])})
        tensor([1., 0.])
    """
    if isinstance(getattr(batch, "labels", None), torch.Tensor):
        return batch.labels
    if isinstance(batch, Mapping):
        for key in _LABEL_KEYS:
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key]
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[-1], torch.Tensor):
        return batch[-1]
    keys = f" with keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else ""
    raise ValueError(
        f"ProgressiveEvaluation: no labels in a batch of type {type(batch).__name__}{keys}: a Batch's labels, a dict's "
        f"{'/'.join(_LABEL_KEYS)} or a tuple's last element were looked for. HINT: ProgressiveEvaluation(predict=fn), "
        "fn(module, batch) -> (scores, labels)."
    )


class ProgressiveEvaluation(pl.Callback):
    """Scores every training batch before the optimizer step that uses it, and reports AUROC, normalized entropy
    and log loss per period (see the module docstring).

    For each batch, before its step, the module's ``forward(batch)`` runs in eval mode without gradients (an extra
    forward per batch); its logits through a sigmoid are the batch's scores. At the end of each period
    the period's metrics (:class:`~lightning_rec.metrics.NormalizedEntropy`, :class:`~lightning_rec.metrics.LogLoss`,
    torchmetrics' ``BinaryAUROC``, each over all ranks' rows) are logged as ``progressive/auroc``, ``progressive/ne``,
    ``progressive/log_loss`` with ``progressive/period`` (the period's number), on the progress bar and to the
    logger, and kept in :attr:`history`. A mid-epoch checkpoint holds the scores of the period in progress, so a
    resumed fit reports that period as the uninterrupted one would.

    Args:
        every_n_batches: periods of this many batches, for training data that declares no periods (without a
            ``periods`` list on its loader or DataModule); ignored where the data declares them.
        thresholds: ``BinaryAUROC(thresholds=...)``: ``None`` (exact: a period's scores are kept until it ends) or a
            number of bins (constant memory).
        from_logits: ``forward`` returns logits (a sigmoid makes them probabilities); ``False``: probabilities.
        predict: ``predict(module, batch) -> (scores, labels)`` in place of ``forward`` and :func:`batch_labels`
            (for a model whose ``forward`` takes something else); run in eval mode without gradients, its scores
            then go through the sigmoid if ``from_logits``.
        prog_bar: show the last period's numbers on the progress bar.
        verbose: also log one line per period (rank 0).

    Attributes:
        history: one dict per period scored, in order: ``epoch``, ``period``, ``start``, ``end``, ``first_event``,
            ``last_event`` (see :class:`~lightning_rec.data.periods.Period`; ``None`` for ``every_n_batches``
            periods), ``rows`` (over all ranks), ``auroc``, ``ne``, ``log_loss``. The same on every rank.

    Example::

        progressive = ProgressiveEvaluation()
        L.Trainer(callbacks=[progressive], ...).fit(model, TabularDataModule(..., period="day", time_column="ts"))
        [(h["start"], round(h["auroc"], 3)) for h in progressive.history]
    """

    def __init__(
        self,
        every_n_batches: int | None = None,
        thresholds: int | None = None,
        from_logits: bool = True,
        predict: Callable[[pl.LightningModule, Any], tuple[torch.Tensor, torch.Tensor]] | None = None,
        prog_bar: bool = True,
        verbose: bool = False,
    ) -> None:
        if every_n_batches is not None and (isinstance(every_n_batches, bool) or int(every_n_batches) < 1):
            raise ValueError(
                f"ProgressiveEvaluation: every_n_batches is {every_n_batches!r}; a number >= 1 was expected."
            )
        self.every_n_batches = every_n_batches
        self.thresholds, self.from_logits, self.predict = thresholds, from_logits, predict
        self.prog_bar, self.verbose = prog_bar, verbose
        self.history: list[dict[str, Any]] = []
        self._metrics = self._new_metrics()
        self._rows = SumMetric()
        self._periods: list[Any] = []
        self._firsts: list[int] = []
        self._scored = 0  # batches scored since the last period ended (the same count on every rank)
        self._restored: dict[str, Any] | None = None

    def _new_metrics(self) -> MetricCollection:
        return MetricCollection(
            {
                "auroc": BinaryAUROC(thresholds=self.thresholds),
                "ne": NormalizedEntropy(validate_args=False),
                "log_loss": LogLoss(validate_args=False),
            }
        )

    # ---- where the periods come from -----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse what cannot be scored before it starts: a pipelined strategy, data without periods."""
        if stage != "fit":
            return
        if getattr(trainer.strategy, "pipeline", False):
            raise ValueError(
                "ProgressiveEvaluation scores each batch with a forward of its own before the step, and a pipelined "
                "strategy (RecShardStrategy(pipeline=True)) runs each sharded module once per batch. HINT: "
                "pipeline=False."
            )
        dm = getattr(trainer, "datamodule", None)
        if self.every_n_batches is None and dm is not None and not getattr(dm, "periods", None):
            self._no_periods(type(dm).__name__)

    def _no_periods(self, what: str) -> None:
        raise ValueError(
            f"ProgressiveEvaluation: the training data ({what}) declares no periods. HINT: "
            "TabularDataModule(period='day', time_column=...) replays the rows in time order by period; on other data, "
            "ProgressiveEvaluation(every_n_batches=N)."
        )

    def _declared(self, trainer: pl.Trainer) -> list[Any]:
        """The training loader's periods (a time-ordered stream's), else the DataModule's, else none."""
        loader = trainer.train_dataloader
        periods = getattr(getattr(loader, "stream", None), "periods", None)
        if not periods:
            periods = getattr(getattr(trainer, "datamodule", None), "periods", None)
        return list(periods or [])

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resolve(trainer)
        self._metrics.to(pl_module.device)
        self._rows.to(pl_module.device)
        if self._restored is not None:  # a mid-period checkpoint: its scores, held by rank 0 (all ranks' rows)
            restored, self._restored = self._restored, None
            self.history = list(restored["history"])
            self._scored = int(restored["scored"])
            if restored["states"] is not None and trainer.global_rank == 0:
                for name, metric in self._each_metric():
                    saved = restored["states"][name]
                    metric.merge_state(
                        {
                            key: [saved[key].to(pl_module.device)] if isinstance(now, list) else saved[key].to(now)
                            for key, now in metric.metric_state.items()
                        }
                    )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resolve(trainer)

    def _resolve(self, trainer: pl.Trainer) -> None:
        """This epoch's periods (at the fit's start too: a fit resumed inside an epoch does not start it again)."""
        self._periods = self._declared(trainer)
        self._firsts = [p.first_batch for p in self._periods]
        if not self._periods and self.every_n_batches is None:
            self._no_periods(type(trainer.train_dataloader).__name__)

    def _period_of(self, batch_idx: int) -> tuple[Any, bool]:
        """The period of the epoch's batch ``batch_idx`` (a declared ``Period`` or a number) and whether it is the
        period's last batch."""
        if self._periods:
            p = self._periods[bisect.bisect_right(self._firsts, batch_idx) - 1]
            return p, batch_idx == p.first_batch + p.batches - 1
        n = int(self.every_n_batches or 1)
        return batch_idx // n, (batch_idx + 1) % n == 0

    # ---- scoring ---------------------------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        scores, labels = self._score(pl_module, batch)
        self._metrics.update(scores, labels)
        self._rows.update(torch.tensor(float(labels.numel()), dtype=torch.float64, device=labels.device))
        self._scored += 1

    def _score(self, module: pl.LightningModule, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's scores (probabilities) and the labels of ``batch``, in eval mode, without gradients; every
        submodule's train/eval mode given back as it was."""
        modes = [(m, m.training) for m in module.modules()]
        module.eval()
        try:
            with torch.no_grad():
                if self.predict is not None:
                    scores, labels = self.predict(module, batch)
                else:
                    scores, labels = module(batch), batch_labels(batch)
        finally:
            for m, training in modes:
                m.training = training
        scores, labels = scores.detach().float().reshape(-1), labels.detach().reshape(-1)
        if scores.numel() != labels.numel():
            raise ValueError(
                f"ProgressiveEvaluation: the model gave {scores.numel()} score(s) for a batch of {labels.numel()} "
                "label(s): one score per row was expected. HINT: ProgressiveEvaluation(predict=fn)."
            )
        return (torch.sigmoid(scores) if self.from_logits else scores), labels.long()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        period, last = self._period_of(batch_idx)
        if last or batch_idx + 1 >= trainer.num_training_batches:
            self._finish(trainer, pl_module, period)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._scored:  # an epoch cut short inside a period (max_steps, limit_train_batches): what it scored
            period, _ = self._period_of(max(trainer.fit_loop.epoch_loop.batch_idx, 0))
            self._finish(trainer, pl_module, period)

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, period: Any) -> None:
        """The period's numbers over every rank (each rank calls this at the same batch), logged and kept."""
        values = {k: float(v) for k, v in self._metrics.compute().items()}
        rows = int(self._rows.compute())
        self._metrics.reset()
        self._rows.reset()
        self._scored = 0
        declared = not isinstance(period, int)
        row = {
            "epoch": trainer.current_epoch,
            "period": period.index if declared else period,
            "start": period.start if declared else None,
            "end": period.end if declared else None,
            "first_event": period.first_event if declared else None,
            "last_event": period.last_event if declared else None,
            "rows": rows,
            "auroc": values["auroc"],
            "ne": values["ne"],
            "log_loss": values["log_loss"],
        }
        self.history.append(row)
        logged = {f"progressive/{k}": row[k] for k in ("auroc", "ne", "log_loss")}
        pl_module.log_dict(
            {**logged, "progressive/period": float(row["period"])},
            prog_bar=self.prog_bar,
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )
        if self.verbose:
            when = f" ({row['start']} to {row['end']})" if declared else ""
            rank_zero_info(
                f"ProgressiveEvaluation: period {row['period']}{when}, {rows} rows: AUROC {row['auroc']:.4f}, "
                f"NE {row['ne']:.4f}, log loss {row['log_loss']:.4f}."
            )

    # ---- checkpoints -----------------------------------------------------------------------------------------------
    def _each_metric(self) -> Sequence[tuple[str, Any]]:
        return [*self._metrics.items(keep_base=True, copy_state=False), ("rows", self._rows)]

    def state_dict(self) -> dict[str, Any]:
        """The periods scored (``history``) and the period in progress: every rank's scores of it gathered (every
        rank saves a checkpoint together; a collective), restored to rank 0 alone, so none is counted twice."""
        states = None
        if self._scored:
            states = {}
            for name, metric in self._each_metric():
                with metric.sync_context(should_sync=True):
                    states[name] = {key: _whole(value) for key, value in metric.metric_state.items()}
        return {"version": 1, "history": list(self.history), "scored": self._scored, "states": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Held until the fit starts (:meth:`on_train_start` knows the rank)."""
        if state_dict.get("version") != 1:
            raise ValueError(
                f"ProgressiveEvaluation: a checkpoint state of version {state_dict.get('version')!r}; this version "
                "reads version 1."
            )
        self._restored = dict(state_dict)


def _whole(state: Any) -> torch.Tensor:
    """A metric state as one tensor on the CPU (a list state's tensors concatenated)."""
    if isinstance(state, list):
        return torch.cat([s.reshape(-1) for s in state]).cpu() if state else torch.zeros(0)
    return state.detach().cpu().clone()
