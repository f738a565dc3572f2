"""Helpers the tests share: real multi-process runs (``dist``), loopback nodes (``elastic``),
one-process references (``parity``), a real S3 server (``s3``)."""
