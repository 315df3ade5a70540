"""Tables' optimizer slots in TensorFlow's object-based checkpoints.

`tf.train.Checkpoint` (and `CheckpointManager`, `tf.saved_model.save`)
save an optimizer's slot variables by asking it `get_slot_names()`, then
`get_slot(variable, name)` for every object they track; they restore them
through the optimizer's `_create_or_restore_slot_variable`. A table's slots
(`table.slots`) are saved that way, beside the table's shard, as this
rank's shard with who held it (as the table itself is). A slot restored
before the optimizer has created it (a checkpoint restored before the first
step) is kept on the table and applied when the optimizer creates it.
"""

from sok_keras.variable import is_sok_variable


class NotATableError(TypeError, KeyError):
    """`get_slot` of a variable that is not a table.

    A `TypeError` for users; a `KeyError` for TensorFlow's checkpointing,
    which asks every tracked object for its slots and skips those that
    raise `KeyError`.
    """

    def __str__(self):
        return str(self.args[0]) if self.args else ""


def slot_names(rule_slot_names, tables):
    """The slot names to report: the rule's, and every table's own (a table
    with its own optimizer may keep other slots)."""
    names = set(rule_slot_names)
    for table in tables:
        if is_sok_variable(table):
            names.update(table.slots)
    return sorted(names)


def table_slot(owner, var, slot_name):
    """Slot `slot_name` of table `var`, or a clear error (see module doc)."""
    if not is_sok_variable(var):
        raise NotATableError(
            f"{owner}.get_slot takes a table (sok.Variable); a dense "
            "variable's state is in the optimizer's `variables`. "
            f"Received: {type(var).__name__} {getattr(var, 'name', '')!r}.")
    if slot_name not in var.slots:
        raise KeyError(
            f"Table '{var.path}' has no slot {slot_name!r}; its slots: "
            f"{sorted(var.slots)} (made when the optimizer is built).")
    return var.slots[slot_name]


def create_or_restore(slot_variable_position, slot_name, variable):
    """`_create_or_restore_slot_variable` for tables: the slot variable for
    TensorFlow to restore, or None once its rows are kept on the table for
    when the optimizer creates it."""
    if not is_sok_variable(variable):
        return None
    if slot_name in variable.slots:
        return variable.slots[slot_name]
    variable.restore_slot_shard(
        slot_name, slot_variable_position.value_tensors())
    return None
