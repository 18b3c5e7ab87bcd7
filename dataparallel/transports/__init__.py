"""Built-in transports, one sub-package each; each registers its URL scheme through the
``dataparallel.transports`` entry-point group, like any third-party transport."""
