"""Native code: target descriptions, object emission, the C driver and the link."""
