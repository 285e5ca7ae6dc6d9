"""Where bytes leave the device: saved activations to the host pool (``pool``, over one pinned
``slab``) and back for backward, and the optimizer off the device (``host_optimizer``: state and
fp32 master weights on the host, fed bucket by bucket by ``host_buckets``, whose gradients wait
in ``host_grads`` where the loop clips or accumulates; ``rewrap``: a DDP built before the plan,
rebuilt in place; ``optim_host`` + ``optim_backward``: the step inside backward;
``handover``: the loop's own optimizer handed over; ``plan_optimizer``: which of them a plan
attaches).
"""
