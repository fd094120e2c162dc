"""Sub-commands of the ``elastor`` CLI (see ``elastor_mcore.cli``)."""
