"""Helpers the tests share: real multi-process runs (``dist``), loopback nodes (``elastic``),
one-process references (``parity``), a real S3 server (``s3``), data files (``data_files``), models
named ``support.models:NAME`` (``models``), the Session parity problem (``regression``), a one-process
Comm (``comm``), bit-for-bit state comparison (``compare``), and whole commands: ``lockstep train``
(``train_cli``), ``lockstep bench`` (``bench``), a job under ``lockstep run`` to inject faults into (``relaunch``)."""
