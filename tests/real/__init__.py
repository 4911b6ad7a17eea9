"""nanhunt on the libraries and training setups people actually run (issue 13): tiny configs built from code,
seeded random weights, nothing downloaded."""
