// Validates Kubernetes custom resources against their CRDs' OpenAPI schemas (the kubernetes-models packages,
// generated from KEDA's and the Prometheus Operator's CRDs). Reads a JSON list of objects on stdin, prints a
// JSON list with an error message (or null) for each. kubernetes-validate (Python) knows only the built-in kinds.
import {ScaledObject} from "@kubernetes-models/keda/keda.sh/v1alpha1";
import {ServiceMonitor} from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";

const KINDS = {"keda.sh/v1alpha1/ScaledObject": ScaledObject, "monitoring.coreos.com/v1/ServiceMonitor": ServiceMonitor};

let input = "";
process.stdin.on("data", (chunk) => { input += chunk; });
process.stdin.on("end", () => {
  const results = JSON.parse(input).map((obj) => {
    const Model = KINDS[`${obj.apiVersion}/${obj.kind}`];
    if (!Model) return `no schema for ${obj.apiVersion} ${obj.kind}`;
    try {
      new Model(obj).validate();
      return null;
    } catch (e) {
      return e.message;
    }
  });
  process.stdout.write(JSON.stringify(results));
});
