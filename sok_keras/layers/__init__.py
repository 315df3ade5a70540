"""Keras layers backed by sharded `sok_keras.Variable` tables."""

from sok_keras.layers.all2all_dense_embedding import All2AllDenseEmbedding
from sok_keras.layers.distributed_embedding import DistributedEmbedding
from sok_keras.layers.embedding_collection import EmbeddingCollection
from sok_keras.layers.localized_embedding import LocalizedEmbedding

__all__ = ["All2AllDenseEmbedding", "DistributedEmbedding",
           "EmbeddingCollection", "LocalizedEmbedding"]
