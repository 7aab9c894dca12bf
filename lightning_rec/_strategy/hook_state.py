"""What one of :class:`~lightning_rec.RecShardStrategy`'s hooks leaves for another: the few flags carried across
Lightning's hooks, in one object, and the rule they enforce that spans four hooks (a backward pass without an
optimizer step).

Example::

    steps = HookState()
    steps.fit_started(check_steps=True)   # setup, when fitting a model with tables
    steps.backward_ran()                  # pre_backward
    steps.check_batch_start(1)            # on_train_batch_start: raises, no optimizer stepped since the backward
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HookState", "backward_without_step_error"]


@dataclass
class HookState:
    """The flags that :class:`~lightning_rec.RecShardStrategy`'s hooks carry from one to another.

    Attributes:
        transferring: a batch is being copied to the device. Set and cleared by ``batch_to_device``, cleared by
            ``on_exception``; read by the failure messages (Lightning counts a batch only once it is on the
            device, so the position they name is one batch further).
        batch_hooks: whether the module or datamodule overrides ``transfer_batch_to_device`` and
            ``on_after_batch_transfer``. Set by ``setup``; read by ``batch_to_device``, which calls them as Lightning
            would.
        redirect_steps: ``training_step`` goes through DMP's DDP forward (not with one rank, where the dense part
            has no DDP). Set by ``setup``; read by ``training_step``.
        check_steps: fitting a model with tables, so every backward pass must be followed by an optimizer step.
            Set by ``setup`` (:meth:`fit_started`).
        backward_without_step: a training backward pass ran (the fused tables updated in it) and no optimizer has
            stepped since (the dense part did not update). Set by ``pre_backward`` (:meth:`backward_ran`), cleared by
            ``optimizer_step`` (:meth:`optimizer_stepped`) and ``setup``; ``on_train_batch_start`` raises on it
            (:meth:`check_batch_start`).
    """

    transferring: bool = False
    batch_hooks: tuple[bool, bool] = (False, False)
    redirect_steps: bool = True
    check_steps: bool = False
    backward_without_step: bool = False

    # "A backward without a step", in one place: setup -> pre_backward -> optimizer_step -> on_train_batch_start.

    def fit_started(self, check_steps: bool) -> None:
        """``setup`` when fitting: whether backward passes must each be followed by a step; none pending."""
        self.check_steps = check_steps
        self.backward_without_step = False

    def backward_ran(self) -> None:
        """``pre_backward``: the tables update in this backward pass; a step must follow before the next batch."""
        self.backward_without_step = self.check_steps

    def optimizer_stepped(self) -> None:
        """``optimizer_step``: the dense part caught up with the tables."""
        self.backward_without_step = False

    def check_batch_start(self, batch_idx: int, owner: str = "RecShardStrategy") -> None:
        """``on_train_batch_start``: refuse a batch that follows a backward pass no optimizer step followed.

        Raises:
            RuntimeError: see :func:`backward_without_step_error`.
        """
        if self.backward_without_step:  # the tables updated in the last batch's backward, the dense part did not
            raise backward_without_step_error(batch_idx, owner)


def backward_without_step_error(batch_idx: int, owner: str = "RecShardStrategy") -> RuntimeError:
    """The error for a training batch whose backward pass ran without any optimizer step (checked when the next
    batch starts)."""
    return RuntimeError(
        f"{owner}: the training batch before batch {batch_idx} ran a backward pass but no optimizer step. The "
        "embedding rows were already updated inside that backward pass (FBGEMM fused optimizer), the dense "
        "parameters were not, so skipping `optimizer.step()` (gradient accumulation in an `optimizer_step` override, "
        "or `opt.step()` every other batch in manual optimization) would silently train the tables and the dense "
        "layers on different batches. HINT: step the optimizer after every backward pass and increase the batch "
        "size instead of accumulating gradients."
    )
