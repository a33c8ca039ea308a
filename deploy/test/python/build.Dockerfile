# The stand-in base's build-stage variant (the Dockerfile's BUILD_IMAGE): pip is given this
# machine's CA bundle (TLS to PyPI goes through it) and the local folder holding torch's CPU
# wheel. Only the image that builds the virtualenv has them; the runtime image does not.
ARG PYTHON_IMAGE=layerswap-test/python:3.11
FROM ${PYTHON_IMAGE}
COPY ca-bundle.crt /etc/layerswap-build/ca-bundle.crt
COPY wheels/ /opt/wheels/
RUN printf '[global]\ncert = /etc/layerswap-build/ca-bundle.crt\nfind-links = /opt/wheels\n' >/etc/pip.conf
