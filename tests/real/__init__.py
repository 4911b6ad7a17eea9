"""nanhunt on the libraries and training setups people actually run: tiny configs built from code,
seeded random weights, nothing downloaded."""
