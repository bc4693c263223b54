"""vlmstream: Kafka-native pipeline from document images to VLM descriptions and vision embeddings."""

__version__ = "0.1.0"
