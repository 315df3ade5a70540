"""Raw ops of the op library given inputs no sok_keras caller makes: each
fails with an `InvalidArgumentError` naming what is wrong, and the process
lives on. (QA: these aborted the process, on TensorFlow's CHECK of an
output shape whose number of elements overflows int64, on an uncaught
allocation exception, or read outside the gradient, a segfault.)"""

import pytest
import tensorflow as tf

from sok_keras import lookup_ops
from sok_keras._ops import ops

IAE = tf.errors.InvalidArgumentError


def _i64(values):
    return tf.constant(values, tf.int64)


CASES = {
    "segment_combine_num_segments_overflow": (
        lambda: ops().sok_segment_combine(
            rows=tf.ones([2, 4]), inverse=tf.constant([0], tf.int32),
            segment_ids=_i64([0]), weights=tf.zeros([0]),
            num_segments=_i64(2 ** 62)),
        ["SokSegmentCombine", "shape"]),
    "segment_combine_helper_num_segments_overflow": (
        lambda: lookup_ops.segment_combine(tf.ones([2, 4]), [0], [0],
                                           num_segments=2 ** 62),
        ["SokSegmentCombine", "shape"]),
    "segment_combine_grad_num_unique_overflow": (
        lambda: ops().sok_segment_combine_grad(
            grad=tf.ones([2, 4]), inverse=tf.constant([0], tf.int32),
            segment_ids=_i64([0]), weights=tf.zeros([0]),
            num_unique=_i64(2 ** 62)),
        ["SokSegmentCombineGrad", "shape"]),
    "scatter_blocks_num_rows_overflow": (
        lambda: ops().sok_scatter_blocks(
            grad=tf.ones([1, 4]), starts=_i64([0]), lengths=_i64([1]),
            num_rows=_i64(2 ** 62)),
        ["SokScatterBlocks", "shape"]),
    "scatter_blocks_rows_too_wide": (
        lambda: ops().sok_scatter_blocks(
            grad=tf.zeros([0, 2 ** 62]), starts=_i64([0]), lengths=_i64([0]),
            num_rows=_i64(1)),
        ["SokScatterBlocks", "too wide"]),
    "pooled_lookup_output_overflow": (
        lambda: ops().sok_pooled_lookup(
            table=tf.zeros([0, 2 ** 62]), ids=tf.zeros([0], tf.int64),
            row_splits=tf.zeros([5], tf.int64), weights=tf.zeros([0]),
            table_name="big"),
        ["'big'", "shape"]),
    "pooled_grad_combine_output_overflow": (
        lambda: ops().sok_pooled_grad_combine(
            grad=tf.zeros([0, 2 ** 40]),
            offsets=tf.zeros([2 ** 24 + 1], tf.int32),
            segments=tf.zeros([0], tf.int64), sorted_weights=tf.zeros([0]),
            denominator=tf.zeros([0])),
        ["shape"]),
    "bucket_pad_rows_too_wide": (
        lambda: ops().sok_bucket_pad(
            x=tf.zeros([0, 2 ** 62]), counts_matrix=tf.zeros([2, 2], tf.int64),
            rank=0),
        ["too wide"]),
    "dedup_bucketize_num_ranks_too_large": (
        lambda: lookup_ops.dedup_bucketize(
            _i64([1, 2]), num_ranks=2 ** 40, vocab_size=10,
            table_name="many"),
        ["'many'", "num_ranks", str(2 ** 40)]),
    "dedup_bucketize_negative_position": (
        lambda: lookup_ops.dedup_bucketize(
            _i64([1, 99]), num_ranks=1, vocab_size=10, table_name="neg",
            raise_on_error=False, positions=_i64([0, -1])),
        ["'neg'", "positions[1] = -1 is negative", "99"]),
    "dedup_bucketize_positions_of_another_length": (
        lambda: lookup_ops.dedup_bucketize(
            _i64([1, 2]), num_ranks=1, vocab_size=10, table_name="len",
            positions=_i64([0])),
        ["'len'", "positions", "(2)"]),
    "pooled_grad_combine_segment_outside_gradient": (
        lambda: ops().sok_pooled_grad_combine(
            grad=tf.ones([2, 4]), offsets=tf.constant([0, 2], tf.int32),
            segments=_i64([0, 10 ** 9]), sorted_weights=tf.zeros([0]),
            denominator=tf.zeros([0])),
        ["segments[1] = 1000000000", "2-row gradient"]),
    "pooled_grad_combine_offsets_past_segments": (
        lambda: ops().sok_pooled_grad_combine(
            grad=tf.ones([2, 4]), offsets=tf.constant([0, 2 ** 30], tf.int32),
            segments=_i64([0, 1]), sorted_weights=tf.zeros([0]),
            denominator=tf.zeros([0])),
        ["offsets", "from 0 to the number of segments (2)"]),
    "pooled_grad_combine_offsets_decrease": (
        lambda: ops().sok_pooled_grad_combine(
            grad=tf.ones([2, 4]), offsets=tf.constant([0, 2, 1, 2], tf.int32),
            segments=_i64([0, 1]), sorted_weights=tf.zeros([0]),
            denominator=tf.zeros([0])),
        ["offsets[2] = 1 < offsets[1] = 2"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_input_is_an_invalid_argument(case):
    make, words = CASES[case]
    with tf.device("/CPU:0"):
        with pytest.raises(IAE) as raised:
            make()
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def test_a_valid_plan_still_combines():
    """The plan checks pass SokPooledGradPlan's own plans: the rows of ids
    [[0, 1], [1]] with sum are grad[0] and grad[0] + grad[1]."""
    grad = tf.constant([[1.0, 2.0], [10.0, 20.0]])
    out = ops().sok_pooled_grad_combine(
        grad=grad, offsets=tf.constant([0, 1, 3], tf.int32),
        segments=_i64([0, 0, 1]), sorted_weights=tf.zeros([0]),
        denominator=tf.zeros([0]))
    assert out.numpy().tolist() == [[1.0, 2.0], [11.0, 22.0]]


def test_a_graph_of_an_earlier_version_without_positions_runs():
    """SokDedupBucketize's `positions` is a list input whose length N
    defaults to 0: a graph (a SavedModel) written before it existed, whose
    node has the ids alone, still imports and runs, naming the position in
    the ids."""
    fn = tf.function(lambda ids: lookup_ops.dedup_bucketize(
        ids, num_ranks=1, vocab_size=10, table_name="old",
        positions=tf.range(tf.size(ids, out_type=tf.int64)) + 5))
    graph = fn.get_concrete_function(
        tf.TensorSpec([None], tf.int64)).graph.as_graph_def()
    nodes = [n for n in graph.node if n.op == "SokDedupBucketize"]
    assert len(nodes) == 1
    node = nodes[0]
    del node.input[1:]  # the earlier node: ids only, no N
    del node.attr["N"]
    # Let the earlier node's graph run: its ids, its outputs.
    outputs = tf.compat.v1.wrap_function(
        lambda: tf.graph_util.import_graph_def(
            graph, input_map={"ids:0": tf.constant([3, 99, 3], tf.int64)},
            return_elements=[f"{node.name}:4"]), [])
    with pytest.raises(IAE, match="'old': id 99 at position 1 "):
        outputs()
