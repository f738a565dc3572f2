"""doctor: is this machine (and every node of this job) ready for distributed training?

* :mod:`~lockstep.doctor.checks`: versions, devices, clock skew, the verdict;
* :mod:`~lockstep.doctor.bandwidth`: allreduce bus bandwidth over message sizes.

An app: may import the library (``lockstep`` and its layers) and ``lockstep.zoo``, never another app.
"""
