"""fusedrl.distributed"""
