"""Low-level helpers every package uses: errors, files, interrupts, trees of tensors, wrappers, environment, the version, bundles, bounded loading."""
