"""Code that runs inside the rank processes torchrun starts, the only part of
``elastic/`` that uses ``torch.distributed``: the training rank's entry point
(``worker``), a multi-node round (``rendezvous_round``) and its entry point
(``node_worker``), the supervisor's hooks in the training loop (``hooks``), the
measurement world of ``elastor profile`` (``measure``) and a traffic diagnostic
(``traffic``). The supervisor side of ``elastic/`` names these modules only as the
strings torchrun starts, never imports them (``tests/test_architecture.py``)."""
