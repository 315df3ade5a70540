"""Tables' optimizer slots in TensorFlow's object-based checkpoints.

`tf.train.Checkpoint` (and `CheckpointManager`, `tf.saved_model.save`)
save an optimizer's slot variables by asking it `get_slot_names()`, then
`get_slot(variable, name)` for every object they track; they restore them
through the optimizer's `_create_or_restore_slot_variable`. A table's slots
(`table.slots`) are saved that way, beside the table's shard, as this
rank's shard with who held it (as the table itself is). A slot restored
before the optimizer has created it (a checkpoint restored before the first
step) is kept on the table and applied when the optimizer creates it.
`TableSlots` gives sok's optimizers these three methods.
"""

import functools
import threading

from sok_keras.optimizers import sparse_rules
from sok_keras.variable import is_sok_variable


class NotATableError(TypeError, KeyError):
    """`get_slot` of a variable that is not a table.

    A `TypeError` for users; a `KeyError` for TensorFlow's checkpointing,
    which asks every tracked object for its slots and skips those that
    raise `KeyError`.
    """

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class TableSlots:
    """SOK's `get_slot_names` / `get_slot` and TensorFlow's slot restore, for
    an optimizer whose rule for tables is its own (`sok.optimizers.*`) or
    its `inner_optimizer`'s (`OptimizerWrapper`)."""

    def get_slot_names(self):
        """SOK's: the names of the slots kept beside tables (`["m", "v"]`
        for Adam; `[]` for plain SGD), with those of tables that have their
        own optimizer. (None while a SavedModel is written: see
        `_trackable_children`.)"""
        if _saving_a_saved_model():
            return []
        rule_of = getattr(self, "inner_optimizer", self)
        try:
            names = {n for n, _ in sparse_rules.rule_for(rule_of).slots(
                rule_of)}
        except ValueError:  # it trains no table (each has its own)
            names = set()
        for table in self._tables():
            names.update(self._slots_of(table))
        return sorted(names)

    def _slots_of(self, table):
        """This optimizer's slots of `table` (those its rule made)."""
        return table.slots_of(sparse_rules.slot_owner(self, table))

    def _tables(self):
        # The wrapper tracks its tables among its variables; sok's
        # optimizers build their Keras base for the dense weights only, and
        # keep the tables they were built for apart (`create_table_slots`).
        tables = [v for v in getattr(self, "_trainable_variables", None) or []
                  if is_sok_variable(v)]
        for table in self.__dict__.get("_sok_built_tables", ()):
            if not any(table is t for t in tables):
                tables.append(table)
        return tables

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        """A SavedModel's loader makes slot variables with the optimizer's
        `add_slot`, which a Keras optimizer revived without its class (a
        plain object) lacks, so `tf.saved_model.load` failed. In a
        SavedModel the tables' slots are this optimizer's plain children
        instead (loaded as variables); checkpoints keep them as slot
        variables, beside their tables."""
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "savedmodel" and _saving_a_saved_model():
            for table in self._tables():
                for name, slot in sorted(self._slots_of(table).items()):
                    key = f"sok_slot.{table.path.replace('/', '.')}.{name}"
                    children[key] = slot
        return children

    def get_slot(self, var, slot_name):
        """SOK's: the slot `slot_name` of table `var`, a `sok.Variable` with
        the table's sharding (made when the optimizer is built).

        Raises:
            TypeError: if `var` is not a table.
            KeyError: naming the table's slots, if it has no such slot.
        """
        return _table_slot(self, var, slot_name)

    def _create_or_restore_slot_variable(self, slot_variable_position,
                                         slot_name, variable, **kwargs):
        del kwargs
        return _create_or_restore(self, slot_variable_position, slot_name,
                                  variable)


def _table_slot(optimizer, var, slot_name):
    """`optimizer`'s slot `slot_name` of table `var`, or a clear error (see
    module doc)."""
    if not is_sok_variable(var):
        raise NotATableError(
            f"{type(optimizer).__name__}.get_slot takes a table "
            "(sok.Variable); a dense variable's state is in the optimizer's "
            f"`variables`. Received: {type(var).__name__} "
            f"{getattr(var, 'name', '')!r}.")
    slots = optimizer._slots_of(var)
    if slot_name not in slots:
        raise KeyError(
            f"Table '{var.path}' has no slot {slot_name!r} of this "
            f"optimizer; its slots: {sorted(slots)} (made when the "
            "optimizer is built).")
    return slots[slot_name]


def _create_or_restore(optimizer, slot_variable_position, slot_name,
                       variable):
    """`_create_or_restore_slot_variable` for tables: `optimizer`'s slot
    variable for TensorFlow to restore, or None once its rows are kept on
    the table for when the optimizer makes it (`Variable.add_slot`)."""
    if not is_sok_variable(variable):
        return None
    slots = optimizer._slots_of(variable)
    if slot_name in slots:
        return slots[slot_name]
    variable.restore_slot_shard(
        slot_name, slot_variable_position.value_tensors(),
        sparse_rules.slot_owner(optimizer, variable))
    return None


# SavedModels being written on this thread (`tf.saved_model.save`, Keras'
# `model.export`): their object graph, and the checkpoint written from it
# outside TensorFlow's save context, must both see the tables' slots as plain
# children, never as slot variables.
_SAVED_MODEL = threading.local()


def _saving_a_saved_model():
    return getattr(_SAVED_MODEL, "depth", 0) > 0


def install():
    """Marks every SavedModel write (TensorFlow's `save_and_return_nodes`,
    which `tf.saved_model.save` calls) for `_saving_a_saved_model`."""
    from tensorflow.python.saved_model import save as tf_save

    original = tf_save.save_and_return_nodes
    if getattr(original, "_sok_keras", False):
        return

    @functools.wraps(original)
    def save_and_return_nodes(*args, **kwargs):
        _SAVED_MODEL.depth = getattr(_SAVED_MODEL, "depth", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            _SAVED_MODEL.depth -= 1

    save_and_return_nodes._sok_keras = True
    tf_save.save_and_return_nodes = save_and_return_nodes
